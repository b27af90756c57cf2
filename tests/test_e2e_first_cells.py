"""A new session's first chart and first frame, on the real backend (issue 37).

- a cold session's first `import matplotlib` reads the font list `coderunner setup` built into the
  sandbox environment (guest/caches.py copied it into the home): it neither scans the fonts nor
  writes a list of its own (a kernel forked from the template, kernel_template, has the fonts its
  template read from that list);
- a kernel started ahead (the warm pool's, a session's reset standby) has numpy, pandas and pyplot
  imported, and nothing of it shows in the user's namespace or execution count; charts come back as
  one image each, with the inline backend and after `matplotlib.use('Agg')`.
"""

from __future__ import annotations

import json

import anyio
import pytest
from mcp import Client

from .conftest import ServerDirs, images_of, json_of, memory_client, run, server_env, text_of
from .test_e2e_pool import pooled_session

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: The first cell of a cold session: the home's font list is the prebuilt one before matplotlib is
#: imported, and matplotlib's own log says which list it used (DEBUG) or that it built one (INFO).
FIRST_CHART = """
import hashlib, logging, os, sys
cache = os.path.expanduser('~/.cache/matplotlib')
prebuilt = os.path.join(sys.prefix, 'share', 'coderunner-cache', 'matplotlib')
def digests(folder):
    if not os.path.isdir(folder):
        return {}
    return {name: hashlib.sha256(open(os.path.join(folder, name), 'rb').read()).hexdigest()
            for name in sorted(os.listdir(folder)) if name.endswith('.json')}
seeded = digests(cache)
print('imported ahead', 'matplotlib.font_manager' in sys.modules)
print('prebuilt', len(digests(prebuilt)))
print('seeded equals prebuilt', seeded == digests(prebuilt) and bool(seeded))
class Keep(logging.Handler):
    def emit(self, record):
        print('log:', record.getMessage())
logger = logging.getLogger('matplotlib.font_manager')
logger.setLevel(logging.DEBUG)
logger.addHandler(Keep())
import matplotlib.pyplot as plt
logger.handlers.clear()
print('unchanged after import', digests(cache) == seeded)
import json, matplotlib.font_manager as fm
listed = [json.load(open(os.path.join(prebuilt, name))) for name in digests(prebuilt)]
print('fonts of the prebuilt list', any(len(fm.fontManager.ttflist) == len(each['ttflist']) for each in listed))
plt.plot([1, 2, 3], [1, 4, 9])
plt.title('first')
plt.show()
"""
#: What a kernel shows of itself: the common modules loaded, and the user's names (none of ours).
MODULES_AND_NAMES = """
import sys
print(sorted(name for name in ('numpy', 'pandas', 'matplotlib.pyplot') if name in sys.modules))
print(sorted(name for name in globals() if not name.startswith('_')
             and name not in ('In', 'Out', 'get_ipython', 'exit', 'quit', 'open', 'sys')))
"""
INLINE_CHART = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()"
AGG_CHART = "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nplt.plot([3, 2, 1])\nplt.show()"
PRELOADED = "['matplotlib.pyplot', 'numpy', 'pandas']"
#: Bound on a session's standby getting ready (a start and the preload, on a loaded 2-core machine).
STANDBY_WAIT_S = 90.0


async def test_a_new_sessions_first_chart_reads_the_prebuilt_font_list(client: Client) -> None:
    reply = await run(client, FIRST_CHART)
    text = text_of(reply)
    assert not reply.is_error, text
    assert "prebuilt 0" not in text, f"no font list in the sandbox environment: run `coderunner setup`\n{text}"
    assert "seeded equals prebuilt True" in text, text
    if "imported ahead True" not in text:  # a cold kernel: its import says which list it read
        assert "log: Using fontManager instance from /tmp/home/.cache/matplotlib/fontlist-v" in text, text
    # else a kernel forked from the template (kernel_template), which read the list before the fork
    assert "generated new fontManager" not in text and "font cache" not in text, text
    assert "unchanged after import True" in text, text
    assert "fonts of the prebuilt list True" in text, text
    assert len(images_of(reply)) == 1, text


async def test_a_kernel_started_ahead_has_the_common_imports_and_a_clean_namespace(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs, CODERUNNER_POOL_SIZE="1")) as client:
        session_id, _ = await pooled_session(client, dirs, "marker")
        shown = text_of(await run(client, MODULES_AND_NAMES, session_id=session_id)).splitlines()
        assert shown[:2] == [PRELOADED, "[]"], shown  # the marker cell bound no name either
        chart = await run(client, INLINE_CHART, session_id=session_id)
        assert len(images_of(chart)) == 1, text_of(chart)

        async def standby_ready() -> bool:
            status = json_of(await client.call_tool("manage_sessions", {"action": "status", "session_id": session_id}))
            return (status.get("standby") or {}).get("preloaded") is True

        status = json_of(await client.call_tool("manage_sessions", {"action": "status", "session_id": session_id}))
        if status.get("standby") is None:
            return  # no reset standby on this backend
        with anyio.move_on_after(STANDBY_WAIT_S):
            while not await standby_ready():
                await anyio.sleep(0.2)
        assert await standby_ready(), json.dumps(status)
        reset = await client.call_tool("kernel_reset", {"session_id": session_id})
        assert not reset.is_error, text_of(reset)
        shown = text_of(await run(client, MODULES_AND_NAMES, session_id=session_id)).splitlines()
        assert shown[:2] == [PRELOADED, "[]"], shown
        chart = await run(client, AGG_CHART, session_id=session_id)
        assert len(images_of(chart)) == 1, text_of(chart)
        assert "cell 2]" in text_of(chart), text_of(chart)  # the warm-up cell left no count behind


async def test_no_preload_leaves_a_kernel_started_ahead_as_it_was(dirs: ServerDirs) -> None:
    env = server_env(dirs, CODERUNNER_POOL_SIZE="1", CODERUNNER_PRELOAD_IMPORTS="false")
    async with memory_client(env) as client:
        session_id, _ = await pooled_session(client, dirs, "marker")
        shown = text_of(await run(client, MODULES_AND_NAMES, session_id=session_id)).splitlines()
        assert shown[:2] == ["[]", "[]"], shown


async def test_a_standby_never_runs_nor_hands_over_a_module_the_workspace_shadows(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs)) as client:
        planted = "open('/workspace/planted-ran', 'a').write('x')\nMARK = 'workspace'\n"
        await run(client, f"open('pandas.py', 'w').write({planted!r})")
        status = json_of(await client.call_tool("manage_sessions", {"action": "status"}))
        if status.get("standby") is None:
            pytest.skip("no reset standby on this backend")

        async def standby_ready() -> bool:
            status = json_of(await client.call_tool("manage_sessions", {"action": "status"}))
            return status["standby"]["state"] == "ready" and status["standby"].get("preloaded") is True

        for _ in range(2):  # the first standby may have preloaded before pandas.py was written
            with anyio.move_on_after(STANDBY_WAIT_S):
                while not await standby_ready():
                    await anyio.sleep(0.2)
            assert await standby_ready()
            found = text_of(await run(client, "import os; print(os.path.exists('/workspace/planted-ran'))"))
            assert found.startswith("False"), found  # no preload ran the workspace's pandas.py
            reset = await client.call_tool("kernel_reset", {})
            assert not reset.is_error, text_of(reset)
        # The standby that preloaded the environment's pandas was not handed over: the user gets theirs.
        shown = text_of(await run(client, "import pandas\nprint(pandas.MARK)"))
        assert shown.startswith("workspace"), shown


async def test_a_one_shot_python_run_reads_the_prebuilt_font_list(client: Client) -> None:
    code = (
        "import logging\n"
        "logging.basicConfig(level=logging.DEBUG, format='log: %(message)s')\n"
        "import matplotlib\n"
        "matplotlib.use('Agg')\n"
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2])\n"
        "plt.savefig('chart.png')\n"
    )
    result = await client.call_tool("execute_code", {"language": "python", "code": code})
    text = text_of(result)
    assert not result.is_error, text
    assert "log: Using fontManager instance from /tmp/home/.cache/matplotlib/fontlist-v" in text, text
    assert "generated new fontManager" not in text, text
