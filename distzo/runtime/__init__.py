"""The process and its device: the way tensors reach the device, host memory readings, and
what every layer writes or reads the same way (logged sizes, JSON from another's file, a
safetensors write: its failure an ``OSError``, its file's mode the umask's); imports
nothing else of distzo."""
