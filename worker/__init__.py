"""What the prefill and the decode worker share (worker/process.py): their Hello, their link to
the coordinator and the process around their loop."""
