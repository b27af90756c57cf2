// Loaded through NODE_OPTIONS in network 'allowlist' sandboxes: Node's built-in fetch then goes
// through HTTP(S)_PROXY like every other client. Node 24+ does this itself (NODE_USE_ENV_PROXY);
// Node 18 to 22 have no such switch, so the global dispatcher (shared with the bundled undici
// through Symbol.for('undici.globalDispatcher.1')) is set from an undici found on the system:
// npm's copy (6.x: EnvHttpProxyAgent) or Debian's node-undici (5.x: ProxyAgent, with loopback
// sent direct here). If none is found, fetch has no network at all (the sandbox has none but the
// proxy): it fails, never unfiltered.
//
// undici tunnels every request (plain http too) with CONNECT, and a refused tunnel only says
// "Proxy response (403) !== 200": fetch's error is given the policy's words instead.
"use strict";

// undici 6: "Proxy response (403) !== 200 when HTTP Tunneling"; 5: no status in it.
const TUNNEL_REFUSED = /Proxy response(?: \((\d+)\))? !== 200/;
// Refused tunnels by origin, for the fetch errors that lost them (bounded).
const refusals = new Map();

function noteRefusal(origin, message) {
  refusals.delete(origin);
  refusals.set(origin, message);
  if (refusals.size > 64) refusals.delete(refusals.keys().next().value);
}

// Short keep-alive: each idle tunnel would keep node running for seconds after its last fetch.
const POOL = { keepAliveTimeout: 10, keepAliveMaxTimeout: 10 };
const DIRECT = new Set(["localhost", "127.0.0.1", "::1", "[::1]"]); // NO_PROXY in these sandboxes

function proxyDispatcher(undici) {
  if (typeof undici.setGlobalDispatcher !== "function") return null;
  if (typeof undici.EnvHttpProxyAgent === "function") {
    const emitWarning = process.emitWarning;
    process.emitWarning = () => {}; // "EnvHttpProxyAgent is experimental" is not the user's concern
    try {
      return new undici.EnvHttpProxyAgent(POOL);
    } finally {
      process.emitWarning = emitWarning;
    }
  }
  if (typeof undici.ProxyAgent !== "function" || typeof undici.Agent !== "function") return null;
  const proxy = new undici.ProxyAgent({ uri: process.env.HTTPS_PROXY || process.env.HTTP_PROXY, ...POOL });
  const direct = new undici.Agent(POOL);
  class ByHost extends undici.Dispatcher {
    dispatch(options, handler) {
      const origin = String(options.origin);
      if (DIRECT.has(new URL(origin).hostname)) return direct.dispatch(options, handler);
      // Node 18's fetch drops the tunnel error from its cause chain: note it by origin for fetch.
      const noting = Object.create(handler);
      noting.onError = function onError(err) {
        if (TUNNEL_REFUSED.test(String(err && err.message))) noteRefusal(origin, err.message);
        return handler.onError.call(this, err);
      };
      return proxy.dispatch(options, noting);
    }
    async close() {
      await Promise.all([proxy.close(), direct.close()]);
    }
    async destroy(err) {
      await Promise.all([proxy.destroy(err), direct.destroy(err)]);
    }
  }
  return new ByHost();
}

function explainRefusals() {
  const fetch = globalThis.fetch;
  if (typeof fetch !== "function") return;
  globalThis.fetch = async function fetchThroughPolicy(input, init) {
    try {
      return await fetch(input, init);
    } catch (err) {
      let url = null;
      try {
        url = new URL(typeof input === "string" || input instanceof URL ? input : input.url);
      } catch (ignored) {
        // keep the generic words
      }
      let match = null;
      for (let cause = err, depth = 0; cause && !match && depth < 4; depth += 1, cause = cause.cause) {
        match = TUNNEL_REFUSED.exec(String(cause.message));
      }
      if (!match && url !== null && refusals.has(url.origin)) {
        match = TUNNEL_REFUSED.exec(refusals.get(url.origin));
        refusals.delete(url.origin);
      }
      if (match) {
        const where = url !== null ? url.host : "this host";
        const why =
          match[1] === "503"
            ? "the sandbox's proxy is at its connection limit; try again when fewer are open"
            : `${where} is not in this session's allowlist, or resolves to a private address` +
              (match[1] ? ` (HTTP ${match[1]})` : "");
        err.message = `${err.message}: blocked by CodeRunner's network policy: ${why}`;
      }
      throw err;
    }
  };
}

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
    const dispatcher = proxyDispatcher(undici);
    if (dispatcher === null) continue;
    undici.setGlobalDispatcher(dispatcher);
    explainRefusals();
    return;
  }
})();
