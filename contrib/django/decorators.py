"""``@gatekeeper_exempt``: a view the Django middleware never limits."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["gatekeeper_exempt"]

ViewT = TypeVar("ViewT")


def gatekeeper_exempt(view: ViewT) -> ViewT:
    """Mark a view (function, ``as_view()`` result or class-based view class) as never
    limited, counted or rejected, e.g. health checks and the status views::

        @gatekeeper_exempt
        def health(request):
            return HttpResponse("ok")
    """
    view.gatekeeper_exempt = True  # type: ignore[attr-defined]
    return view
