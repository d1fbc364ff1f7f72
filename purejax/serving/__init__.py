"""A model served over HTTP in OpenAI's API: `python -m purejax.serve --init_from=MODEL`.

    protocol   what the API's requests may hold, checked field by field (a 400 that
               names the field), and its responses and stream chunks, shaped as
               OpenAI's
    app        the ASGI application (Starlette): routes, limits, API key, the engine's
               thread, streaming, metrics and one log line per request
    static/    the chat page served at `/`: plain HTML and JavaScript, no CDN

Every request runs on one `purejax.engine.Engine`: requests join its rows as
they arrive and stream their tokens out as they decode.
"""
