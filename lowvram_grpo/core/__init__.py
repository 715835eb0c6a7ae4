"""The ground room: what every room uses (errors and exit codes, stops, commands' shared parts, the host allocator
and memory, the door to private names); it imports no other room of the package."""
