// Test-only: drives CodeRunner with the official MCP TypeScript SDK (tests/test_e2e_tsclient.py).
//
//   node harness.mjs '<json>'   with {scenario, transport: "stdio"|"http", command, args, env, url, token, params}
//
// Prints one JSON line, {ok: true, result} or {ok: false, error}, on stdout; the pytest side asserts on
// `result`. A scenario is one async function in scenarios.mjs: (client, ctx) => any JSON value.
// ctx.connect({token, headers}) opens one more client on the same server (e.g. another token's).

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

import { scenarios } from "./scenarios.mjs";

function transportFor(spec, overrides = {}) {
  if (spec.transport === "stdio") {
    return new StdioClientTransport({ command: spec.command, args: spec.args, env: spec.env, stderr: "inherit" });
  }
  const token = overrides.token ?? spec.token;
  const headers = { ...(token ? { Authorization: `Bearer ${token}` } : {}), ...(overrides.headers ?? {}) };
  return new StreamableHTTPClientTransport(new URL(spec.url), { requestInit: { headers } });
}

async function connect(spec, opened, overrides = {}) {
  const client = new Client({ name: "coderunner-tsclient-tests", version: "0" });
  await client.connect(transportFor(spec, overrides));
  opened.push(client);
  return client;
}

async function main() {
  const spec = JSON.parse(process.argv[2]);
  const scenario = scenarios[spec.scenario];
  if (!scenario) throw new Error(`no scenario ${spec.scenario}; known: ${Object.keys(scenarios).join(", ")}`);
  const opened = [];
  try {
    const client = await connect(spec, opened);
    const ctx = { params: spec.params ?? {}, connect: (overrides) => connect(spec, opened, overrides) };
    return await scenario(client, ctx);
  } finally {
    for (const client of opened) await client.close().catch(() => {});
  }
}

main().then(
  (result) => {
    process.stdout.write(JSON.stringify({ ok: true, result }) + "\n");
    process.exit(0);
  },
  (error) => {
    process.stdout.write(JSON.stringify({ ok: false, error: String(error?.stack ?? error) }) + "\n");
    process.exit(1);
  },
);
