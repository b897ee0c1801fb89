"""What the server, the devices and the emulator share: the wire protocol, CURVE keys, the base error,
the config schema, allocator tuning, atomic file writes and a Ctrl-C held back mid-message.
Nothing here imports the other layers."""
