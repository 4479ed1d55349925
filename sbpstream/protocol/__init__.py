"""SBP protocol: frames, opcodes, errors, extended headers. Imports no asyncio, socket or ssl."""
