"""A small Django project for the Django integration tests (in-process and under gunicorn)."""

from __future__ import annotations


def configure() -> None:
    """Configure Django in this process from ``tests.django_project.settings``, once.

    The test modules call it at import, so the rest of the suite runs without any
    ``DJANGO_SETTINGS_MODULE``; gunicorn gets the settings module through its environment.
    """
    import django
    from django.conf import settings

    if settings.configured:
        return
    from tests.django_project import settings as project_settings

    settings.configure(
        **{
            name: getattr(project_settings, name)
            for name in dir(project_settings)
            if name.isupper()
        }
    )
    django.setup()
