#!/bin/sh
# Claude Code: add CodeRunner as a stdio server (a server of its own for each Claude Code process).
claude mcp add coderunner -- /path/to/coderunner/.venv/bin/coderunner serve

# Or share one long-running server (`coderunner serve --transport streamable-http`) over HTTP:
#   claude mcp add --transport http coderunner http://127.0.0.1:8765/mcp \
#       --header "Authorization: Bearer $(/path/to/coderunner/.venv/bin/coderunner token)"
