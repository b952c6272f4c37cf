"""``samcache serve``: samcache's engine behind OpenAI's chat-completions API.

- :mod:`samcache.serve.app`: the FastAPI app (routes, errors, streaming) over the engine's online
  step loop (:mod:`samcache.engine.online`);
- :mod:`samcache.serve.requests`: the request bodies, checked, as the engine's requests;
- :mod:`samcache.serve.images`: images from data URLs (and allowed local folders), under limits;
- :mod:`samcache.serve.reply_text`: incremental detokenization and stop strings;
- :mod:`samcache.serve.metrics`: ``/metrics`` in Prometheus' text format;
- :mod:`samcache.serve.main`: the command line.

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus_client).
"""
