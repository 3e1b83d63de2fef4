"""The OpenAI-compatible HTTP server (``pagedspec serve``; the ``serve`` extra:
``pip install "pagedspec[serve]"``). :func:`pagedspec.serve.app.build_app` makes the FastAPI app
over an :class:`~pagedspec.engine.async_engine.AsyncEngine`; :func:`pagedspec.serve.app.main`
is the command. Nothing here is imported by the rest of the package."""
