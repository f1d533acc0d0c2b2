"""The process and its device: the way tensors reach the device, host memory readings, and
what every layer writes or reads the same way (logged sizes, JSON from another's file, a
failed safetensors write as an ``OSError``); imports nothing else of distzo."""
