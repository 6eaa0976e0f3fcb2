"""The OpenAI-compatible HTTP gateway (`pdserve gateway`): the app (server.py), request and
response shapes (schema.py), response formatting (format.py), the coordinator streams behind one
HTTP request (stream.py), the models it serves, each behind its own coordinator (models.py), and
its Prometheus metrics (metrics.py). It reaches the coordinator through the client library, like
any other client."""
