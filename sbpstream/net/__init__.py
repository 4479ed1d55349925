"""The one asyncio connection layer shared by the PM, the data nodes and the SDK."""
