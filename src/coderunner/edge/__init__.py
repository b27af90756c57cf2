"""The edge: who is calling, and how requests reach the server.

auth.py             bearer token, Host/Origin checks on HTTP
http_limits.py      bounds on connections and request heads; repeated identity fields refused
refusals.py         one log line per refused HTTP request: the reason and the client's address, no token
listener.py         the HTTP socket, bound before any sandbox starts (a busy port is one line)
callers.py          which client a call comes from (its default session)
client_tokens.py    per-client tokens (`coderunner token`)
session_binding.py  an MCP session id works only with the token that opened it
stdio_proxy.py      `coderunner proxy`: stdio in front of an HTTP server
client_configs.py   snippets that add CodeRunner to MCP clients
client_code.py      code that connects agent libraries
"""
