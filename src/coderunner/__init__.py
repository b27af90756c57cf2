"""CodeRunner: a persistent, sandboxed Python kernel for AI agents, served over MCP."""

__version__ = "0.1.0"
