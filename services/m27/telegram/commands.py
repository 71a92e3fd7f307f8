"""What a chat message asks for, decided without any I/O (pure).

    decide(message, allow, bot_username) → Refuse | Say | Act

`Refuse`: the sender is not on the allow list (nothing runs, nothing is revealed).
`Say`: an answer needing no call (help, a malformed command, a document too large).
`Act`: a parsed command, for the m27 user the sender is allowed as; the shell carries it
out against the API.
"""

from __future__ import annotations

import re
import shlex
from typing import Final

import msgspec

from m27.common import notifications
from m27.common.ids import is_valid_run_id
from m27.common.notifications import ButtonAction, NoticeKind, read_button
from m27.pipeline import MAX_PIPELINE_BYTES
from m27.telegram import text
from m27.telegram.allow import AllowList

#: The largest pipeline document the bot downloads (the pipeline language's own limit).
MAX_DOCUMENT_BYTES: Final = MAX_PIPELINE_BYTES
MAX_VARS: Final = 100
MAX_RUNS_LISTED: Final = 30
DEFAULT_RUNS_LISTED: Final = 10
#: Every command, in the order /help lists them (BotFather's menu: setMyCommands).
MENU: Final[tuple[tuple[str, str], ...]] = (
    ("submit", "submit a pipeline (attach the YAML or paste it) [NAME=VALUE …]"),
    ("runs", "your recent runs [N]"),
    ("status", "a run's state and steps: /status RUN"),
    ("cancel", "cancel a run: /cancel RUN"),
    ("retry", "run again what did not succeed: /retry RUN"),
    ("report", "a run's main curve and its HTML report: /report RUN"),
    ("nodes", "the lab's nodes and GPUs"),
    ("queue", "what waits and what runs"),
    ("subscribe", "notifications in this chat [KINDS…] [run=GLOB]"),
    ("unsubscribe", "no more notifications in this chat"),
    ("help", "what the bot can do"),
)
_COMMAND: Final = re.compile(r"/([A-Za-z0-9_]{1,64})(?:@([A-Za-z0-9_]{1,64}))?")
_FENCE: Final = re.compile(r"^```[A-Za-z0-9_+-]*[ \t]*\n?(.*?)\n?```[ \t]*$", re.DOTALL)
_VAR_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


class Document(msgspec.Struct, frozen=True, kw_only=True):
    """A file attached to a message, as Telegram describes it (not yet downloaded)."""

    file_id: str
    file_name: str = ""
    file_size: int | None = None


class Incoming(msgspec.Struct, frozen=True, kw_only=True):
    """A message to the bot (or a button pressed: `text` is then its callback data)."""

    user_id: int
    chat_id: int
    text: str = ""
    document: Document | None = None
    button: bool = False


# ---------------------------------------------------------------- commands (what to do)


class Help(msgspec.Struct, frozen=True, tag=True):
    start: bool = False


class Submit(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """A pipeline to plan and submit: pasted (`pipeline`) or a document to fetch."""

    variables: dict[str, str]
    pipeline: str = ""
    document: Document | None = None
    source_name: str = "pipeline.yaml"
    no_cache: bool = False


class Runs(msgspec.Struct, frozen=True, tag=True):
    limit: int = DEFAULT_RUNS_LISTED


RunAction = ButtonAction  # a command on a run, typed or pressed


class OnRun(msgspec.Struct, frozen=True, tag=True):
    action: RunAction
    run_id: str


class Nodes(msgspec.Struct, frozen=True, tag=True):
    pass


class Queue(msgspec.Struct, frozen=True, tag=True):
    pass


class Subscribe(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    kinds: tuple[NoticeKind, ...]
    runs: tuple[str, ...] = ()


class Unsubscribe(msgspec.Struct, frozen=True, tag=True):
    pass


Command = Help | Submit | Runs | OnRun | Nodes | Queue | Subscribe | Unsubscribe


# ---------------------------------------------------------------- decisions


class Refuse(msgspec.Struct, frozen=True, tag=True):
    text: str


class Say(msgspec.Struct, frozen=True, tag=True):
    text: str


class Act(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    user: str  # the m27 user the sender is allowed as
    command: Command


Decision = Refuse | Say | Act


def decide(message: Incoming, allow: AllowList, bot_username: str = "") -> Decision:
    """What to do with `message`: refused unless its sender is allowed; else the command
    it carries, or what is wrong with it."""
    user = allow.user_of(message.user_id)
    if user is None:
        return Refuse(text.refusal(message.user_id))
    if message.button:
        return _button(message.text, user)
    parsed = parse(message.text, message.document, bot_username)
    if parsed is None:
        return Say(text.NOT_FOR_ME)
    if isinstance(parsed, str):
        return Say(parsed)
    return Act(user=user, command=parsed)


def _button(data: str, user: str) -> Decision:
    pressed = read_button(data)
    if pressed is None or not is_valid_run_id(pressed[1]):
        return Say("That button is no longer understood; send /help.")
    return Act(user=user, command=OnRun(action=pressed[0], run_id=pressed[1]))


def parse(message: str, document: Document | None = None,
          bot_username: str = "") -> Command | str | None:
    """The command in a message (its text, or a document's caption): the command, what is
    wrong with it (a sentence for the chat), or None for a message that is no command."""
    stripped = message.lstrip()
    match = _COMMAND.match(stripped)
    if match is None or (match.end() < len(stripped)
                         and not stripped[match.end()].isspace()):
        if document is not None:
            return "To run this pipeline, send it again with /submit as its caption."
        return None
    name, addressed = match.group(1).lower(), match.group(2)
    if addressed and bot_username and addressed.lower() != bot_username.lower():
        return None  # a command for another bot in the same group
    first_line, _, rest = stripped[match.end():].partition("\n")
    if name == "submit":
        return _submit(first_line, rest, document)
    if document is not None:
        return f"/{name} takes no file; attach a pipeline to /submit."
    return _plain(name, first_line.split() + rest.split())


def _plain(name: str, words: list[str]) -> Command | str:
    if name in ("help", "start"):
        return Help(start=name == "start")
    if name == "runs":
        return _runs(words)
    if name in ("status", "cancel", "retry", "report"):
        return _on_run(name, words)  # type: ignore[arg-type]
    if name in ("nodes", "queue", "unsubscribe"):
        if words:
            return f"/{name} takes no arguments."
        return Nodes() if name == "nodes" else Queue() if name == "queue" else Unsubscribe()
    if name == "subscribe":
        return _subscribe(words)
    return f"Unknown command /{name[:64]}; send /help for what I understand."


def _runs(words: list[str]) -> Runs | str:
    if not words:
        return Runs()
    if len(words) == 1 and words[0].isdigit() and 1 <= int(words[0]) <= MAX_RUNS_LISTED:
        return Runs(limit=int(words[0]))
    return f"/runs takes at most one number, 1 to {MAX_RUNS_LISTED}: how many runs to list."


def _on_run(action: RunAction, words: list[str]) -> OnRun | str:
    if len(words) != 1:
        return f"/{action} needs one run id: /{action} r-20261201-081500-a1b2c3"
    if not is_valid_run_id(words[0]):
        return (f"Not a run id: {words[0][:80]!r} (run ids look like "
                "r-20261201-081500-a1b2c3; /runs lists yours).")
    return OnRun(action=action, run_id=words[0])


def _subscribe(words: list[str]) -> Subscribe | str:
    kinds: list[str] = []
    globs: tuple[str, ...] = ()
    for word in words:
        key, eq, value = word.partition("=")
        if not eq:
            kinds.append(word)
        elif key == "run":
            globs = tuple(g for g in value.split(",") if g)
        else:
            return (f"/subscribe: unknown filter {key[:40]!r}= (only run=GLOB; the chat "
                    "gets notices about your own runs)")
    try:
        chosen = notifications.kinds_of(kinds, "/subscribe") if kinds \
            else notifications.DEFAULT_KINDS
        runs = _run_globs(globs) if globs else ()
    except ValueError as exc:
        return str(exc)
    return Subscribe(kinds=chosen, runs=runs)


def _run_globs(globs: tuple[str, ...]) -> tuple[str, ...]:
    """The globs, checked by the notification rules' own parser (one checker only)."""
    line = f"all run={','.join(globs)} -> telegram"
    try:
        (rule,) = notifications.parse_rules(line)
    except ValueError as exc:
        said = str(exc)
        where = f"rule 1 ({line[:60]!r}): "
        raise ValueError("/subscribe: " + said.removeprefix(where)) from exc
    return rule.runs


def _submit(first_line: str, rest: str, document: Document | None) -> Submit | str:
    try:
        words = shlex.split(first_line)
    except ValueError as exc:
        return f"/submit: cannot read the arguments ({exc}); quote values with spaces."
    no_cache = "--no-cache" in words
    variables = parse_vars([w for w in words if w != "--no-cache"])
    if isinstance(variables, str):
        return variables
    if document is not None:
        return _submit_document(document, variables, no_cache, rest)
    pasted = unfence(rest.strip("\n"))
    if not pasted.strip():
        return ("/submit needs a pipeline: attach the YAML file with /submit as its "
                "caption, or paste it on the lines after /submit.")
    if len(pasted.encode("utf-8", "surrogatepass")) > MAX_DOCUMENT_BYTES:
        return f"The pipeline is larger than {MAX_DOCUMENT_BYTES // 1024} KiB."
    return Submit(variables=variables, pipeline=pasted, no_cache=no_cache)


def _submit_document(document: Document, variables: dict[str, str], no_cache: bool,
                     rest: str) -> Submit | str:
    if rest.strip():
        return "/submit takes a file or a pasted pipeline, not both."
    size = document.file_size
    if size is not None and size > MAX_DOCUMENT_BYTES:
        return (f"{safe_file_name(document.file_name)} is {size // 1024} KiB; a pipeline "
                f"may be at most {MAX_DOCUMENT_BYTES // 1024} KiB.")
    return Submit(variables=variables, document=document, no_cache=no_cache,
                  source_name=safe_file_name(document.file_name))


def parse_vars(words: list[str]) -> dict[str, str] | str:
    """`NAME=VALUE` words (the CLI's `--var`) → variables, or what is wrong."""
    if len(words) > MAX_VARS:
        return f"/submit: at most {MAX_VARS} NAME=VALUE arguments."
    result: dict[str, str] = {}
    for word in words:
        name, eq, value = word.partition("=")
        if not eq or not _VAR_NAME.fullmatch(name):
            return f"/submit: expected NAME=VALUE, got {word[:80]!r}"
        result[name] = value
    return result


def unfence(pasted: str) -> str:
    """A pipeline pasted in a ``` code block (fences still in the text) → its YAML."""
    match = _FENCE.match(pasted.strip())
    return match.group(1) if match else pasted


def safe_file_name(name: str) -> str:
    """A document's name as it may appear in messages and error locations."""
    cleaned = re.sub(r"[^A-Za-z0-9._+-]", "_", name.rsplit("/", 1)[-1])[:100].strip("._")
    return cleaned or "pipeline.yaml"


def decode_pipeline(data: bytes, name: str) -> str:
    """A downloaded document as text; ValueError (as `m27 submit` says it) when it is too
    large or not UTF-8."""
    if len(data) > MAX_DOCUMENT_BYTES:
        raise ValueError(f"{name}: larger than {MAX_DOCUMENT_BYTES // 1024} KiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name}: not UTF-8 text (byte {exc.start})") from exc
