// Loaded through NODE_OPTIONS in network 'allowlist' sandboxes: Node's built-in fetch then goes
// through HTTP(S)_PROXY like every other client. Node 24+ does this itself (NODE_USE_ENV_PROXY);
// Node 20 and 22 have no such switch, so the global dispatcher is set to undici's EnvHttpProxyAgent,
// taken from an undici found on the system (npm's copy, or Debian's node-undici). If none is found,
// fetch has no network at all (the sandbox has none but the proxy): it fails, never unfiltered.
//
// undici tunnels every request (plain http too) with CONNECT, and a refused tunnel only says
// "Proxy response (403) !== 200": fetch's error is given the policy's words instead.
"use strict";
(function useEnvProxy() {
  if (!process.env.HTTPS_PROXY && !process.env.HTTP_PROXY) return;
  const major = Number(process.versions.node.split(".")[0]);
  if (major >= 24 && process.env.NODE_USE_ENV_PROXY) return;
  const candidates = [
    "/usr/lib/node_modules/npm/node_modules/undici",
    "/usr/share/nodejs/undici",
    "/usr/lib/nodejs/undici",
  ];
  for (const path of candidates) {
    let undici;
    try {
      undici = require(path);
    } catch (err) {
      continue; // not there: try the next one
    }
    if (typeof undici.EnvHttpProxyAgent !== "function" || typeof undici.setGlobalDispatcher !== "function") {
      continue;
    }
    const emitWarning = process.emitWarning;
    process.emitWarning = () => {}; // "EnvHttpProxyAgent is experimental" is not the user's concern
    try {
      undici.setGlobalDispatcher(new undici.EnvHttpProxyAgent({ keepAliveTimeout: 10, keepAliveMaxTimeout: 10 }));
    } finally {
      process.emitWarning = emitWarning;
    }
    explainRefusals();
    return;
  }
})();

function explainRefusals() {
  const fetch = globalThis.fetch;
  if (typeof fetch !== "function") return;
  globalThis.fetch = async function fetchThroughPolicy(input, init) {
    try {
      return await fetch(input, init);
    } catch (err) {
      let cause = err;
      for (let depth = 0; cause && depth < 4; depth += 1, cause = cause.cause) {
        const match = /Proxy response \((\d+)\)/.exec(String(cause.message));
        if (match) {
          let where = "this host";
          try {
            const url = new URL(typeof input === "string" || input instanceof URL ? input : input.url);
            where = url.host;
          } catch (ignored) {
            // keep the generic words
          }
          const why =
            match[1] === "503"
              ? "the sandbox's proxy is at its connection limit; try again when fewer are open"
              : `${where} is not in this session's allowlist, or resolves to a private address (HTTP ${match[1]})`;
          err.message = `${err.message}: blocked by CodeRunner's network policy: ${why}`;
          break;
        }
      }
      throw err;
    }
  };
}
