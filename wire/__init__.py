"""What every pdserve process shares: the msgspec protocol (protocol.py), a worker's link to the
coordinator (link.py), CurveZMQ keys and the loopback rule (security.py), ZeroMQ sockets
served from an asyncio loop (loop_io.py), and the liveness file a role touches for its launcher
(liveness.py). It imports only the torch-free corner of runtime
(sampling parameters, errors), so clients stay light; nothing here imports a serving package."""
