// Loaded through NODE_OPTIONS in network 'allowlist' sandboxes: Node's built-in fetch then goes
// through HTTP(S)_PROXY like every other client. Node 24+ does this itself (NODE_USE_ENV_PROXY);
// Node 20 and 22 have no such switch, so the global dispatcher is set to undici's EnvHttpProxyAgent,
// taken from an undici found on the system (npm's copy, or Debian's node-undici). If none is found,
// fetch has no network at all (the sandbox has none but the proxy): it fails, never unfiltered.
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
    try {
      const undici = require(path);
      if (typeof undici.EnvHttpProxyAgent === "function" && typeof undici.setGlobalDispatcher === "function") {
        undici.setGlobalDispatcher(new undici.EnvHttpProxyAgent());
        return;
      }
    } catch (err) {
      // not there, or too old: try the next one
    }
  }
})();
