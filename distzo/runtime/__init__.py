"""Facts of the machine a rank runs on: its devices and its host memory; imports nothing
else of distzo."""
