"""One execute's result and how it is gathered: the kernel's IOPub messages for one request, turned
into a RunOutcome (status, output, the cell's error, the execution count, a guest tool's answer)."""

from __future__ import annotations

import enum
import json
import re
import time
from dataclasses import dataclass
from typing import Any

from coderunner.kernel.channels import Message
from coderunner.kernel.output_capture import OutputCollector

#: Richest first: a display that offers several (a PIL image: PNG and JPEG) sends one, the first that fits.
IMAGE_MIME_TYPES = ("image/png", "image/jpeg")
#: Text a display offers when its text/plain says nothing (a repr like <IPython.core.display.HTML object>).
RICH_TEXT_TYPES = ("text/markdown", "text/html", "text/latex", "application/json")
#: A default object repr: the class, and perhaps an address, and nothing else.
_BARE_REPR = re.compile(r"<[\w.]+ object(?: at 0x[0-9a-fA-F]+)?>")
#: The display bundle type guest tools answer with (coderunner_guest.dispatch.RESULT_MIME).
GUEST_RESULT_MIME = "application/vnd.coderunner.guest+json"


class RunStatus(enum.Enum):
    OK = "ok"
    ERROR = "error"  # the code raised
    INTERRUPTED = "interrupted"  # deadline hit, interrupt worked: state kept
    UNRESPONSIVE = "unresponsive"  # deadline hit, interrupt ignored: needs a restart
    DIED = "died"  # the sandbox exited during the run


@dataclass
class CellError:
    """The exception a cell raised (not an error of the kernel itself): name, value, traceback text."""

    ename: str
    evalue: str
    traceback: str


@dataclass
class RunOutcome:
    status: RunStatus
    output: OutputCollector
    error: CellError | None = None
    execution_count: int | None = None
    duration_s: float = 0.0
    exit_code: int | None = None
    output_lost: bool = False
    #: What a guest tool answered (see coderunner_guest.dispatch), when this run was one.
    guest_payload: dict[str, Any] | None = None


@dataclass
class RunState:
    """State of one execute while its IOPub messages arrive."""

    msg_id: str
    output: OutputCollector
    status: RunStatus = RunStatus.OK
    error: CellError | None = None
    execution_count: int | None = None
    exit_code: int | None = None
    idle: bool = False
    #: When the execute_reply was seen on the shell channel (only looked for while IOPub is quiet).
    reply_at: float | None = None
    #: IOPub messages of this run were skipped (over MAX_MESSAGE_BYTES, or unreadable).
    output_lost: bool = False
    guest_payload: dict[str, Any] | None = None

    def take_reply(self, content: dict[str, Any]) -> None:
        self.reply_at = time.monotonic()
        self.execution_count = content.get("execution_count", self.execution_count)
        if content.get("status") == "error" and self.status is RunStatus.OK:
            self.status = RunStatus.ERROR
            self.error = CellError(str(content.get("ename", "")), str(content.get("evalue", "")), "")

    def handle(self, msg: Message) -> None:
        kind = msg.msg_type
        content = msg.content
        if kind == "stream":
            self.output.add_text(str(content.get("text", "")))
        elif kind in ("execute_result", "display_data"):
            self._add_bundle(content.get("data", {}))
            if kind == "execute_result":
                self.execution_count = content.get("execution_count", self.execution_count)
        elif kind == "execute_input":
            self.execution_count = content.get("execution_count")
        elif kind == "error":
            self.status = RunStatus.ERROR
            self.error = CellError(
                ename=str(content.get("ename", "")),
                evalue=str(content.get("evalue", "")),
                traceback="\n".join(str(line) for line in content.get("traceback", [])),
            )
            self.output.add_text(self.error.traceback + "\n")
        elif kind == "status" and content.get("execution_state") == "idle":
            self.idle = True

    def _add_bundle(self, data: dict[str, Any]) -> None:
        if isinstance(data.get(GUEST_RESULT_MIME), dict):
            self.guest_payload = data[GUEST_RESULT_MIME]
            return
        images = [mime for mime in IMAGE_MIME_TYPES if isinstance(data.get(mime), str)]
        if images:
            # One image per display: the richest kind that still goes in the reply, else the richest (saved).
            chosen = next((mime for mime in images if self.output.fits_inline(data[mime])), images[0])
            self.output.add_image(chosen, data[chosen])
        text = display_text(data)
        if text is not None and not (images and text.startswith("<Figure")):
            self.output.add_text(text if text.endswith("\n") else text + "\n")


def display_text(data: dict[str, Any]) -> str | None:
    """A display bundle's text: its text/plain, unless that only names the object's class and the bundle
    has the content as text of another kind (HTML, Markdown, LaTeX, JSON), which the model reads instead."""
    plain = data.get("text/plain")
    if isinstance(plain, str) and not _BARE_REPR.fullmatch(plain.strip()):
        return plain
    for mime in RICH_TEXT_TYPES:
        rich = data.get(mime)
        if isinstance(rich, str):
            return rich
        if mime == "application/json" and isinstance(rich, (dict, list)):
            return json.dumps(rich, indent=1)
    return plain if isinstance(plain, str) else None
