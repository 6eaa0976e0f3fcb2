"""KV block transfer between workers: one interface (KVSender / KVReceiver in transfer.py) over
four backends, one class each in backends.py: shm and tcp (CPU pools), cuda_ipc and nccl (GPU
pools, cupy). pool.py holds the pool tensor and the block copy every backend that writes in place
uses; errors.py the typed hand-off errors."""
