"""Files in and out, end to end through the MCP client: the user stories, then every way out."""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import os
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path

import anyio
import pytest
from mcp import Client

from .conftest import ServerDirs, images_of, memory_client, run, server_env, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


@dataclass
class Host:
    """Host folders the user chose, and everything else the test watches for changes."""

    data: Path
    out: Path
    imports: Path
    elsewhere: Path


@pytest.fixture
def host(dirs: ServerDirs) -> Host:
    folders = Host(*(dirs.root / name for name in ("data", "out", "imports", "elsewhere")))
    for folder in (folders.data, folders.out, folders.imports, folders.elsewhere):
        folder.mkdir(mode=0o755)
    rng = random.Random(7)
    with open(folders.data / "sales.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["date", "region", "units", "price"])
        for day in range(1, 121):
            for region in ("north", "south", "east", "west"):
                units = rng.randint(5, 50) if (day, region) != (45, "east") else 900
                writer.writerow([(date(2026, 1, 1) + timedelta(days=day - 1)).isoformat(), region, units, 9.5])
    (folders.imports / "notes.txt").write_text("imported from the host\n")
    (folders.elsewhere / "secret.txt").write_text("not for the sandbox\n")
    os.symlink(folders.elsewhere / "secret.txt", folders.imports / "sneaky-link.txt")
    return folders


def files_env(dirs: ServerDirs, host: Host) -> dict[str, str]:
    return server_env(
        dirs,
        CODERUNNER_MOUNTS=json.dumps([f"{host.data}:/data:ro"]),
        CODERUNNER_EXPORT_DIR=str(host.out),
        CODERUNNER_EXPORT_MOUNT="/out",
        CODERUNNER_IMPORT_DIRS=json.dumps([str(host.imports)]),
    )


def exports_of(host: Host) -> Path:
    """Where the local client's exports land (an unnamed HTTP client's `http`: test_e2e_transports.py)."""
    return host.out / "local"


@pytest.fixture
async def client(dirs: ServerDirs, host: Host) -> AsyncIterator[Client]:
    async with memory_client(files_env(dirs, host)) as connected:
        yield connected


def snapshot(*folders: Path) -> dict[str, str]:
    """Every file under the folders with a hash of its content: what "nothing else changed" means."""
    found = {}
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_symlink():
                found[str(path)] = "link:" + os.readlink(path)
            elif path.is_file():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


async def call(client: Client, tool: str, **arguments: object) -> dict:  # type: ignore[type-arg]
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, text_of(result)
    return json.loads(text_of(result))


async def refused(client: Client, tool: str, needle: str, **arguments: object) -> str:
    result = await client.call_tool(tool, arguments)
    assert result.is_error, f"{tool} {arguments} was not refused: {text_of(result)}"
    assert needle in text_of(result), text_of(result)
    return text_of(result)


# --- the user stories ----------------------------------------------------------------------------


async def test_story_load_a_read_only_host_folder(client: Client, host: Host) -> None:
    """'Load /data/sales.csv into df. Show schema + 5 sample rows.'"""
    before = snapshot(host.data, host.out, host.elsewhere)
    result = await run(client, "import pandas as pd\ndf = pd.read_csv('/data/sales.csv')\nprint(df.dtypes)\ndf.head(5)")
    text = text_of(result)
    assert not result.is_error, text
    assert "region" in text and "units" in text and "int64" in text and "north" in text
    writes = await run(client, "open('/data/evil.csv', 'w')")
    assert writes.is_error and "Read-only file system" in text_of(writes)
    await refused(client, "write_file", "read-only mount /data", path="/data/evil.csv", content="x")
    assert snapshot(host.data, host.out, host.elsewhere) == before


async def test_story_export_only_into_the_chosen_folder(client: Client, host: Host) -> None:
    """'Pivot by region x month, show top 5 anomalies. Save the anomalies subset to /out/anomalies.csv on host.'"""
    before = snapshot(host.data, host.elsewhere)
    result = await run(
        client,
        "import pandas as pd\n"
        "df = pd.read_csv('/data/sales.csv', parse_dates=['date'])\n"
        "df['month'] = df.date.dt.to_period('M')\n"
        "pivot = df.pivot_table(index='region', columns='month', values='units', aggfunc='sum')\n"
        "z = (df.units - df.units.mean()) / df.units.std()\n"
        "anomalies = df.loc[z.abs().sort_values(ascending=False).index[:5]]\n"
        "anomalies.to_csv('/out/anomalies.csv', index=False)\n"
        "print(pivot.shape)\nanomalies",
    )
    assert not result.is_error, text_of(result)
    assert "900" in text_of(result)
    out = exports_of(host)
    assert str(out / "") in text_of(result) and "anomalies.csv" in text_of(result), "the reply says where it went"
    assert sorted(path.name for path in host.out.iterdir()) == [out.name]
    assert sorted(path.name for path in out.iterdir()) == ["anomalies.csv"]
    assert "900" in (out / "anomalies.csv").read_text()
    assert snapshot(host.data, host.elsewhere) == before


async def test_story_chart_and_csv_downloaded_to_the_export_folder_only(client: Client, host: Host) -> None:
    """'Add a chart of weekly mileage. Save CSV + chart to ./out/ on host (this only).'"""
    before = snapshot(host.data, host.imports, host.elsewhere)
    made = await run(
        client,
        "import pandas as pd, matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
        "weeks = pd.DataFrame({'week': range(1, 9), 'km': [21, 25, 30, 18, 33, 35, 28, 40]})\n"
        "weeks.to_csv('mileage.csv', index=False)\n"
        "weeks.plot(x='week', y='km', kind='bar').figure.savefig('mileage.png')",
    )
    assert not made.is_error, text_of(made)
    out = exports_of(host)
    for name in ("mileage.csv", "mileage.png"):
        copied = await call(client, "transfer_file", direction="download", sandbox_path=name)
        assert copied["host_path"] == str(out / name)
    assert sorted(path.name for path in out.iterdir()) == ["mileage.csv", "mileage.png"]
    assert (out / "mileage.png").read_bytes().startswith(b"\x89PNG")
    assert "40" in (out / "mileage.csv").read_text()
    chart = await client.call_tool("read_file", {"path": "mileage.png"})
    assert images_of(chart)[0] == (out / "mileage.png").read_bytes()
    await refused(client, "transfer_file", "already exists", direction="download", sandbox_path="mileage.csv")
    assert snapshot(host.data, host.imports, host.elsewhere) == before


async def test_story_only_the_chosen_folders_are_visible(client: Client, host: Host) -> None:
    """'Mount only ~/data and ~/out; everything else is invisible.'"""
    result = await run(
        client,
        "import os, json\n"
        f"print(json.dumps({{'root': sorted(os.listdir('/')), 'data': os.listdir('/data'),"
        f" 'run': [[d, sorted(f)] for d, _, f in os.walk('/run')] if os.path.isdir('/run') else [],"
        f" 'elsewhere': os.path.exists({str(host.elsewhere)!r}), 'home': os.path.exists({str(Path.home())!r})}}))",
    )
    seen = json.loads(text_of(result).splitlines()[0])
    assert "sales.csv" in seen["data"]
    assert seen["elsewhere"] is False and seen["home"] is False
    assert set(seen["root"]) <= {"bin", "dev", "etc", "lib", "lib64", "opt", "proc", "sbin", "tmp", "usr", "workspace",
                                 "data", "out", "lib32", "libx32", "run"}  # fmt: skip
    # /run holds only the kernel's own connection file (its key, private to this sandbox), nothing of the host.
    assert all(files in ([], ["connection.json"]) for _, files in seen["run"]), seen["run"]
    status = json.loads(text_of(await client.call_tool("manage_sessions", {"action": "status"})))
    assert {(m["sandbox"], m["mode"]) for m in status["mounts"]} == {("/data", "ro"), ("/out", "rw")}


# --- the file tools ------------------------------------------------------------------------------


async def test_write_list_read_roundtrip_and_ranges(client: Client) -> None:
    await call(client, "write_file", path="notes/day1.txt", content="\n".join(f"line {i}" for i in range(1, 101)))
    await call(client, "write_file", path="blob.bin", content=base64.b64encode(bytes(range(256))).decode(),
               encoding="base64")  # fmt: skip
    listing = await call(client, "read_file", path="/workspace", depth=2)
    paths = {entry["path"]: entry for entry in listing["entries"]}
    assert paths["/workspace/notes/day1.txt"]["size"] > 0 and paths["/workspace/notes"]["kind"] == "dir"
    lines = await client.call_tool("read_file", {"path": "notes/day1.txt", "start_line": 10, "end_line": 12})
    assert text_of(lines).startswith("line 10\nline 11\nline 12\n[lines 10-12]")
    ranged = await client.call_tool("read_file", {"path": "notes/day1.txt", "offset": 0, "length": 6})
    assert text_of(ranged).startswith("line 1\n[bytes 0-6 of")
    blob = await client.call_tool("read_file", {"path": "blob.bin"})
    embedded = next(block for block in blob.content if block.type == "resource")
    assert base64.b64decode(embedded.resource.blob) == bytes(range(256))
    code_sees = await run(client, "open('notes/day1.txt').read().count('line')")
    assert text_of(code_sees).splitlines()[0] == "100"


async def test_big_files_and_spilled_output_come_back_as_resource_links(client: Client) -> None:
    result = await run(client, "for i in range(100_000):\n    print('row', i)")
    links = [block for block in result.content if block.type == "resource_link"]
    assert len(links) == 1 and links[0].uri.startswith("sandbox://")
    contents = await client.read_resource(links[0].uri)
    body = contents.contents[0]
    data = body.text if hasattr(body, "text") else base64.b64decode(body.blob).decode()
    assert "row 0\n" in data and "row 99999" in data
    await run(client, "open('big.bin', 'wb').write(bytes(1_000_000))")
    big = await client.call_tool("read_file", {"path": "big.bin"})
    assert [block.type for block in big.content] == ["text", "resource_link"]


async def test_upload_from_an_import_folder(client: Client, host: Host) -> None:
    uploaded = await call(client, "transfer_file", direction="upload", host_path=str(host.imports / "notes.txt"))
    assert uploaded["sandbox_path"] == "/workspace/notes.txt"
    assert "imported from the host" in text_of(await run(client, "open('notes.txt').read()"))


# --- every way out -------------------------------------------------------------------------------


async def test_paths_outside_the_workspace_and_mounts_are_refused(client: Client) -> None:
    for path in ("../../etc/passwd", "/etc/passwd", "/workspace/../../root/.bashrc", "/opt/coderunner/env/pyvenv.cfg",
                 str(Path.home() / ".bashrc")):  # fmt: skip
        await refused(client, "read_file", "outside what the sandbox shares", path=path)
    await refused(client, "write_file", "outside what the sandbox shares", path="/tmp/../etc/evil", content="x")
    await refused(client, "read_file", "outside what the sandbox shares", path="/")


async def test_symlinks_out_of_the_workspace_and_mounts_are_refused(client: Client, host: Host) -> None:
    made = await run(
        client,
        "import os\n"
        "os.symlink('/etc/passwd', 'to-etc')\n"
        f"os.symlink({str(host.elsewhere / 'secret.txt')!r}, 'to-host-path')\n"
        "os.symlink('../../../../../../', 'to-root')\n"
        "os.symlink('/workspace/../../proc/self/environ', '/out/from-export')\n"
        "os.symlink('/data/sales.csv', 'to-data')\n"
        "'made'",
    )
    assert not made.is_error, text_of(made)
    for path in ("to-etc", "to-host-path", "to-root/etc/shadow", "/out/from-export"):
        await refused(client, "read_file", "outside what the sandbox shares", path=path)
    await refused(client, "write_file", "outside what the sandbox shares", path="to-root/tmp/x", content="x")
    # A link that stays inside what the sandbox shares is followed, as the sandbox itself would.
    assert "region" in text_of(await client.call_tool("read_file", {"path": "to-data", "end_line": 1}))
    await refused(
        client, "transfer_file", "outside what the sandbox shares", direction="download", sandbox_path="to-host-path"
    )


#: Bound on the swap test's racing reads (each one is checked for a leak).
MAX_RACING_READS = 1_500


async def test_a_symlink_swapped_in_during_reads_never_leaks_host_files(client: Client) -> None:
    """Sandboxed code flips a path between a file and a link to a host file while the host reads it."""
    host_secret = Path("/etc/hostname").read_text().strip() or "localhost"
    flipper = await run(
        client,
        "import os, threading\n"
        "stop = threading.Event()\n"
        "def flip():\n"
        "    while not stop.is_set():\n"
        "        open('.staged', 'w').write('SAFE')\n"
        "        os.replace('.staged', 'victim')\n"
        "        os.symlink('/etc/hostname', '.staged-link')\n"
        "        os.replace('.staged-link', 'victim')\n"
        "threading.Thread(target=flip, daemon=True).start()\n'flipping'",
    )
    assert not flipper.is_error
    outcomes = {"safe": 0, "refused": 0}
    # At least 150 reads race the flipper, and more (up to MAX_RACING_READS) until one lands on the file:
    # on a loaded machine most reads meet the link, and a few hundred tries can all lose the race.
    tries = 0
    while tries < 150 or (outcomes["safe"] == 0 and tries < MAX_RACING_READS):
        tries += 1
        result = await client.call_tool("read_file", {"path": "victim"})
        text = text_of(result)
        if result.is_error:
            outcomes["refused"] += 1
        else:
            assert text == "SAFE", f"the host read something else through a swapped link: {text!r}"
            outcomes["safe"] += 1
        assert host_secret not in text or text == "SAFE"
    await run(client, "stop.set()")
    assert outcomes["safe"] > 0, outcomes


async def test_upload_only_from_import_folders(client: Client, host: Host) -> None:
    await refused(
        client,
        "transfer_file",
        "outside the folders allowed",
        direction="upload",
        host_path=str(host.elsewhere / "secret.txt"),
    )
    await refused(client, "transfer_file", "outside the folders allowed",
                  direction="upload", host_path=str(host.imports / ".." / "elsewhere" / "secret.txt"))  # fmt: skip
    await refused(client, "transfer_file", "outside what the sandbox shares",
                  direction="upload", host_path=str(host.imports / "sneaky-link.txt"))  # fmt: skip


async def test_download_only_into_the_export_folder(client: Client, host: Host) -> None:
    before = snapshot(host.data, host.imports, host.elsewhere)
    await call(client, "write_file", path="result.txt", content="done")
    out = exports_of(host)
    for target in (str(host.elsewhere / "result.txt"), "../elsewhere/result.txt", "/tmp/result.txt", str(out),
                   str(host.out / "someone-else" / "result.txt")):  # fmt: skip
        result = await client.call_tool(
            "transfer_file", {"direction": "download", "sandbox_path": "result.txt", "host_path": target}
        )
        assert result.is_error, target
    # A link planted in the sandbox's export mount is neither exported nor followed.
    planted = await run(client, f"import os\nos.symlink({str(host.elsewhere)!r}, '/out/escape')")
    assert "escape (not a regular file)" in text_of(planted)
    copied = await call(
        client, "transfer_file", direction="download", sandbox_path="result.txt", host_path="escape/result.txt"
    )
    assert copied["host_path"] == str(out / "escape" / "result.txt")
    assert not (out / "escape").is_symlink()
    assert snapshot(host.data, host.imports, host.elsewhere) == before
    assert not (host.elsewhere / "result.txt").exists()


async def test_special_files_are_refused_without_hanging(client: Client) -> None:
    await run(client, "import os\nos.mkfifo('pipe')")
    with anyio.fail_after(10):
        await refused(client, "read_file", "not a regular file", path="pipe")
        await refused(client, "write_file", "not a regular file", path="pipe", content="x")


async def test_mounting_home_or_root_is_refused(dirs: ServerDirs, host: Host) -> None:
    import subprocess

    from .conftest import SERVER_CMD

    for bad in (str(Path.home()), "/", str(Path.home().parent)):
        done = subprocess.run(
            [*SERVER_CMD, "--mount", f"{bad}:/data:ro"], env=files_env(dirs, host), stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode != 0 and "refusing to mount" in done.stderr, done.stderr


# --- workspace lifecycle -------------------------------------------------------------------------


async def test_named_persistent_workspace_survives_close_and_server_restart(dirs: ServerDirs, host: Host) -> None:
    env = files_env(dirs, host)
    async with memory_client(env) as client:
        first = await call(client, "create_session", name="analysis", persistent=True)
        assert first["name"] == "analysis" and first["persistent"] is True
        await run(client, "state = 'in memory'\nopen('kept.txt', 'w').write('on disk')", session_id=first["session_id"])
        await refused(client, "create_session", "in use", name="analysis", persistent=True)
        await call(client, "manage_sessions", action="close", session_id=first["session_id"])
        again = await call(client, "create_session", name="analysis", persistent=True)
        assert "'on disk'" in text_of(await run(client, "open('kept.txt').read()", session_id=again["session_id"]))
        lost = await run(client, "state", session_id=again["session_id"])
        assert lost.is_error and "NameError" in text_of(lost)
        temporary = await call(client, "create_session", name="scratch")
        await run(client, "open('gone.txt', 'w').write('x')", session_id=temporary["session_id"])
    async with memory_client(env) as client:  # a new server, same configuration
        reopened = await call(client, "create_session", name="analysis", persistent=True)
        result = await run(client, "sorted(os.listdir('.')) if (os := __import__('os')) else 0",
                           session_id=reopened["session_id"])  # fmt: skip
        assert "kept.txt" in text_of(result)
    leftovers = sorted(path.name for path in dirs.session_workspaces() if path.is_dir())
    assert leftovers == ["named"], "temporary workspaces are removed, the named one is kept"
    assert (dirs.workspaces / "named" / "local" / "analysis").is_dir(), "a name belongs to its client (stdio: local)"


async def test_session_mounts_only_under_allowed_roots(dirs: ServerDirs, host: Host) -> None:
    project = host.data / "project"
    project.mkdir()
    (project / "readme.md").write_text("project files\n")
    env = {**files_env(dirs, host), "CODERUNNER_ALLOWED_MOUNT_ROOTS": json.dumps([str(host.data)])}
    async with memory_client(env) as client:
        session = await call(client, "create_session", mounts=[f"{project}:/project:ro"])
        seen = await run(client, "open('/project/readme.md').read()", session_id=session["session_id"])
        assert "project files" in text_of(seen)
        await refused(client, "create_session", "may not be mounted", mounts=[f"{host.elsewhere}:/elsewhere:ro"])
        await refused(client, "create_session", "refusing to mount", mounts=["/:/everything:ro"])
        await refused(client, "create_session", "reserved", mounts=[f"{project}:/usr/project:ro"])
