// Scenarios the official TypeScript SDK plays against CodeRunner. Each is one async function
// (client, ctx) => JSON value; tests/test_e2e_tsclient.py names it and asserts on what it returns.
// Keep the checks that need the SDK's own behaviour here, and the assertions on the pytest side.

import { AjvJsonSchemaValidator } from "@modelcontextprotocol/sdk/validation/ajv";
import { DEFAULT_REQUEST_TIMEOUT_MSEC } from "@modelcontextprotocol/sdk/shared/protocol.js";

/** The text blocks of a tool result, joined. */
export function textOf(result) {
  return result.content.filter((block) => block.type === "text").map((block) => block.text).join("\n");
}

/** run_python with the SDK's defaults (a 60 s request timeout) unless `options` says otherwise. */
export function run(client, code, options, extra = {}) {
  return client.callTool({ name: "run_python", arguments: { code, ...extra } }, undefined, options);
}

async function sessionId(client) {
  const status = await client.callTool({ name: "manage_sessions", arguments: { action: "status" } });
  return JSON.parse(textOf(status)).session_id;
}

export const scenarios = {
  /** Snapshot, fork and restore through the TypeScript SDK: structured replies, state in new sessions. */
  async snapshots(client) {
    const call = async (name, args) => {
      const result = await client.callTool({ name, arguments: args });
      return { reply: result.structuredContent ?? JSON.parse(textOf(result)), isError: result.isError ?? false };
    };
    await run(client, "import numpy as np\nweights = np.arange(6).reshape(2, 3)\ndef score(k):\n    return int(weights.sum()) * k");
    const taken = await call("manage_snapshots", { action: "save", name: "ts" });
    const forked = await call("manage_snapshots", { action: "fork" });
    await run(client, "weights = weights * 0", { }, { session_id: forked.reply.session_id });
    const restored = await call("manage_snapshots", { action: "restore", snapshot: taken.reply.snapshot });
    const look = "print(score(2))";
    return {
      taken: taken.reply,
      forked: forked.reply,
      restored: restored.reply,
      original: textOf(await run(client, look)),
      inFork: textOf(await run(client, look, {}, { session_id: forked.reply.session_id })),
      inRestored: textOf(await run(client, look, {}, { session_id: restored.reply.session_id })),
      listed: (await call("manage_snapshots", { action: "list" })).reply,
    };
  },

  /** Variables persist across calls of one client. */
  async state(client) {
    const first = await run(client, "secret = 6 * 7");
    const second = await run(client, "secret");
    return { first: textOf(first), second: textOf(second), isError: second.isError ?? false };
  },

  /** A chart comes back as an image content block (Agg + plt.show(), as models often write it). */
  async chart(client) {
    const code =
      "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n" +
      "plt.plot([1, 4, 9])\nplt.title('squares')\nplt.show()";
    const result = await run(client, code);
    return {
      text: textOf(result),
      blocks: result.content.map((block) => ({
        type: block.type,
        mimeType: block.mimeType ?? null,
        head: block.type === "image" ? Buffer.from(block.data, "base64").subarray(0, 8).toString("hex") : null,
        bytes: block.type === "image" ? Buffer.from(block.data, "base64").length : null,
      })),
    };
  },

  /** Progress notifications while a cell runs; with resetTimeoutOnProgress they keep a short timeout alive. */
  async progress(client) {
    const seen = [];
    const code = "import time\nfor i in range(6):\n    print(f'step {i}', flush=True)\n    time.sleep(0.5)\n'done'";
    const result = await run(client, code, {
      onprogress: (note) => seen.push(note),
      timeout: 2000,
      resetTimeoutOnProgress: true,
      maxTotalTimeout: 120000,
    });
    return { text: textOf(result), isError: result.isError ?? false, progress: seen };
  },

  /** Aborting the request (AbortSignal) interrupts the cell; the kernel and its state are kept. */
  async cancel(client) {
    await run(client, "kept = 'still here'");
    const controller = new AbortController();
    let progressed = 0;
    let abortError = null;
    const code = "import time\nticks = 0\nwhile True:\n    ticks += 1\n    time.sleep(0.01)";
    try {
      await run(client, code, {
        signal: controller.signal,
        // Abort once the server says the cell is running (a progress note), not after a guessed delay.
        onprogress: () => {
          progressed += 1;
          controller.abort(new Error("stopped by the user"));
        },
      }, { timeout_s: 300 });
    } catch (error) {
      abortError = String(error?.message ?? error);
    }
    // Had the cell kept running, this call would wait behind it until its 300 s limit: bounded at 30 s.
    const after = await run(client, "(kept, ticks > 0)", { timeout: 30000 });
    return { progressed, abortError, after: textOf(after), isError: after.isError ?? false };
  },

  /** A cell over the server's timeout_s: the "interrupted; state kept" reply arrives within the SDK's default. */
  async timeout(client) {
    await run(client, "before = 'kept'");
    const timedOut = await run(client, "while True:\n    pass");
    const after = await run(client, "before");
    return {
      sdkDefaultTimeoutMs: DEFAULT_REQUEST_TIMEOUT_MSEC,
      timedOut: textOf(timedOut),
      timedOutIsError: timedOut.isError ?? false,
      after: textOf(after),
    };
  },

  /** sandbox:// resources read back with their MIME type, text as text. */
  async resources(client) {
    await run(
      client,
      "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n" +
        "plt.plot([1, 2])\nplt.savefig('chart.png')\nplt.close('all')\n" +
        "open('table.csv', 'w').write('x,y\\n1,2\\n')",
    );
    const base = `sandbox://${await sessionId(client)}/workspace/`;
    const read = async (name) => {
      const item = (await client.readResource({ uri: base + name })).contents[0];
      return {
        mimeType: item.mimeType,
        text: item.text ?? null,
        blobHead: item.blob ? Buffer.from(item.blob, "base64").subarray(0, 8).toString("hex") : null,
      };
    };
    const templates = await client.listResourceTemplates();
    return { png: await read("chart.png"), csv: await read("table.csv"), templates: templates.resourceTemplates };
  },

  /**
   * Two clients of one server (over HTTP; over stdio each has a server of its own): the second neither
   * sees the first's variables nor lists its sessions. ctx.params.second is how the second connects
   * ({token, headers}); by default the same token, as another MCP session. What it gets when it
   * presents the first one's session id is returned as is, for the caller to judge.
   */
  async two_clients(client, ctx) {
    await run(client, "private_value = 'only for the first client'");
    const made = JSON.parse(textOf(await client.callTool({ name: "create_session", arguments: {} })));
    const other = await ctx.connect(ctx.params.second ?? {});
    const peek = await run(other, "private_value");
    const listed = JSON.parse(textOf(await other.callTool({ name: "manage_sessions", arguments: { action: "list" } })));
    const borrowed = await run(other, "1 + 1", undefined, { session_id: made.session_id });
    await client.callTool({ name: "manage_sessions", arguments: { action: "close", session_id: made.session_id } });
    return {
      peek: textOf(peek),
      peekIsError: peek.isError ?? false,
      firstSessionListed: listed.sessions.some((session) => session.session_id === made.session_id),
      borrowed: textOf(borrowed),
      borrowedIsError: borrowed.isError ?? false,
    };
  },

  /** tools/list as the SDK parses it, and every input schema compiled by the SDK's own Ajv validator. */
  async tools(client) {
    const { tools } = await client.listTools();
    const validator = new AjvJsonSchemaValidator();
    const compiled = {};
    for (const tool of tools) {
      try {
        validator.getValidator(tool.inputSchema);
        compiled[tool.name] = "ok";
      } catch (error) {
        compiled[tool.name] = String(error?.message ?? error);
      }
    }
    const runPython = validator.getValidator(tools.find((tool) => tool.name === "run_python").inputSchema);
    return {
      names: tools.map((tool) => tool.name),
      compiled,
      runPythonAcceptsCode: runPython({ code: "1 + 1" }).valid,
      runPythonRefusesNoCode: !runPython({}).valid,
      called: textOf(await run(client, "sum(range(10))")),
    };
  },
};
