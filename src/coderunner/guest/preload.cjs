// Loaded by `node --require` before a one-shot program: the variables become globals, as data.
"use strict";
const fs = require("fs");
const path = process.env.CODERUNNER_VARIABLES_FILE;
delete process.env.CODERUNNER_VARIABLES_FILE;
if (path) {
  const variables = JSON.parse(fs.readFileSync(path, "utf8"));
  for (const [name, value] of Object.entries(variables)) {
    globalThis[name] = value;
  }
}
