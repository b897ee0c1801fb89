"""What the server, the devices and the emulator share: the wire protocol, CURVE keys, the base error,
the config schema, allocator tuning and atomic file writes. Nothing here imports the other layers."""
