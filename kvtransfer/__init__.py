"""KV block transfer between workers: one interface (KVSender / KVReceiver), backends shm and tcp."""
