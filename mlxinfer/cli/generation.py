"""`mlxinfer generate` and `mlxinfer chat`: text from a model loaded here, or from the resident server's."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from click import termui

from ..api import Model
from ..engine import structure_of
from ..errors import GrammarError, ImageError, MlxInferError, ModelNotFoundError
from ..grammar import MAX_GRAMMAR_CHARS
from ..library import located, models_dir, record_use
from ..local_server import find_server, server_identity
from ..resident_client import RemoteModel, RemoteStream, model_field
from ..untrusted import read_json_object
from ..vision import file_data_url
from .common import errors_as_one_line, load_model
from .library import pull
from .options import adapter_pairs, checked_generation, generation_options, take_speculation


@click.command()
@generation_options
@click.option("--prompt", "-p", required=True, help="Prompt text, or - to read it from stdin.")
@click.option("--chat/--raw", default=True, show_default=True, help="Apply the model's chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and the stats.")
@click.option(
    "--schema",
    "schema_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A JSON schema file: the answer is JSON valid against it.",
)
@click.option("--regex", default=None, help="The whole answer matches this regular expression.")
@click.option("--choice", "choice", multiple=True, help="The answer is exactly one of these (repeatable).")
@click.option(
    "--image",
    "images",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="An image to ask about, before the prompt (repeatable; a model that reads images, e.g. Gemma 3).",
)
@errors_as_one_line
def generate(
    model: str | None, prompt: str, chat: bool, as_json: bool, system: str | None, images: tuple[Path, ...],
    **options: Any,
) -> None:  # fmt: skip
    """Generate a completion for one prompt.

    MODEL: a model folder, a .gguf file, or none for the default SmolLM2-135M-Instruct.

    \b
    Examples:
      mlxinfer generate -p "What is the capital of France?"
      mlxinfer generate ~/models/Qwen3-0.6B -p "Once upon a time" --raw -t 0.8 --seed 1
      echo "Summarize: ..." | mlxinfer generate -p - --json
      mlxinfer generate -p "Invent a person." --schema person.json     # JSON valid against the schema
      mlxinfer generate -p "Is water wet?" --choice yes --choice no
      mlxinfer generate ~/models/Qwen3-4B-4bit --draft-model ~/models/Qwen3-0.6B-4bit -p "Hi"   # speculative
      mlxinfer generate ~/models/gemma-3-4b-it --image chart.png -p "What does this chart show?"
    """
    if images and not chat:
        raise click.UsageError("--image needs the chat template; drop --raw")
    dtype, kv_bits = options.pop("dtype"), options.pop("kv_bits")
    speculation = take_speculation(options)
    adapters = adapter_pairs([a for a in [options.pop("adapter")] if a])
    schema_file = options.pop("schema_file")
    structured = _structure_options(schema_file, options.pop("regex"), options.pop("choice"))
    local = options.pop("local") or bool(structured.get("regex") or structured.get("choices"))
    generation = checked_generation(options)  # before the load: a bad flag should not cost one
    text = sys.stdin.read() if prompt == "-" else prompt
    llm = _model_for(model, local, dtype, quiet=as_json, kv_bits=kv_bits, adapters=adapters, **speculation)
    if adapters:
        generation["adapter"] = next(iter(adapters))
    messages = _messages(text, system, [file_data_url(p, "--image") for p in images]) if chat else text
    try:  # the grammar compiles here, for this model's tokenizer: an unsupported keyword names the file
        run = llm.stream(messages, chat=chat, **generation, **structured)
    except GrammarError as e:
        raise click.ClickException(f"{schema_file}: {e}" if schema_file else str(e)) from None
    structure = structure_of(**structured)
    if as_json:
        for _ in run:
            pass
        payload = {**_model_facts(llm), "text": run.text(), "finish_reason": run.stats.finish_reason}
        if structure and structure.is_json:  # the answer as a JSON value, not a string holding it
            payload["parsed"] = structure.parse(run.text(), run.stats.finish_reason)
        click.echo(json.dumps({**payload, "stats": run.stats.to_dict()}, ensure_ascii=False))
        return
    for chunk in run:
        click.echo(chunk, nl=False)
    click.echo()
    click.echo(run.stats.summary(), err=True)
    if structure:  # a cut-off answer is not what the constraint promised: say so and exit non-zero
        structure.check_complete(run.stats.finish_reason)


@click.command()
@generation_options
@errors_as_one_line
def chat(model: str | None, system: str | None, **options: Any) -> None:
    """Chat with a model in the terminal; answers stream as they are generated.

    MODEL: a model folder, a .gguf file, or none for the default SmolLM2-135M-Instruct.

    \b
    Commands (/help lists them): /image FILE attaches an image to your next message (a model that reads images),
    /system TEXT sets the system prompt, /reset clears the conversation, /save FILE writes it as JSON, /bye (or
    /exit, Ctrl-D) quits. Ctrl-C stops the current answer.
    """
    dtype, kv_bits = options.pop("dtype"), options.pop("kv_bits")
    speculation = take_speculation(options)
    adapters = adapter_pairs([a for a in [options.pop("adapter")] if a])
    local = options.pop("local")
    generation = checked_generation(options)  # before the load: a bad flag should not cost one
    llm = _model_for(model, local, dtype, quiet=False, kv_bits=kv_bits, adapters=adapters, **speculation)
    if adapters:
        generation["adapter"] = next(iter(adapters))
    session = _Session(system)
    name = llm.path.name if isinstance(llm, Model) else llm.name or "the server's model"
    click.echo(f"Chatting with {name}. /help lists the commands, /bye quits.", err=True)
    while True:
        line = _read_line()
        if line is None or (line.strip().startswith("/") and not session.command(line.strip())):
            click.echo("Bye.", err=True)
            return
        if not line.strip() or line.strip().startswith("/"):
            continue
        session.history += _messages(line, None, session.attached)
        session.attached = []
        try:
            answer = _stream_answer(llm, session.history, generation)
        except MlxInferError as e:  # one bad turn (a template refusal, say) does not end the chat
            click.secho(f"Error: {e}", err=True, fg="red")
            session.history.pop()
            continue
        session.history.append({"role": "assistant", "content": answer})


@click.command("run")
@generation_options
@click.option("--yes", "-y", is_flag=True, help="Pull without asking when MODEL is a Hub id not here yet.")
@click.pass_context
@errors_as_one_line
def run_model(ctx: click.Context, model: str | None, yes: bool, **options: Any) -> None:
    """Chat with a model by its name, pulling it from the Hugging Face Hub first when it is not here.

    MODEL: a name `mlxinfer ls` shows, a Hub id (org/name; pulled into the models folder when neither the
    models folder nor the Hugging Face cache has it), a model folder or a .gguf file; none for the default
    SmolLM2-135M-Instruct. Then as `mlxinfer chat` (the same options and commands).
    """
    if model and not located(model).exists():
        if model.count("/") != 1:
            raise ModelNotFoundError(
                f"{model}: no model by that name here; `mlxinfer ls` lists them, and a Hub id (org/name) is pulled"
            )
        ctx.invoke(pull, hub_id=model, yes=yes)
        model = str(models_dir() / model.rsplit("/", 1)[-1])
    ctx.invoke(chat, model=model, **options)


COMMANDS = {
    "/help": "list these commands",
    "/image FILE": "attach an image to your next message",
    "/system TEXT": "set the system prompt (alone: show it)",
    "/reset": "clear the conversation (the system prompt stays)",
    "/save FILE": "write the conversation to FILE as JSON (a new file)",
    "/bye": "quit (also /exit, /quit, Ctrl-D)",
}


class _Session:
    """The chat's conversation, its system prompt and the images attached to the next message."""

    def __init__(self, system: str | None):
        self.system = system
        self.history = _messages(None, system)
        self.attached: list[str] = []

    def command(self, line: str) -> bool:
        """Run a /command, saying what it did; False to quit."""
        word, _, rest = line.partition(" ")
        rest = rest.strip()
        if word in ("/bye", "/exit", "/quit"):
            return False
        if word in ("/help", "/?"):
            click.echo("\n".join(f"  {name:<14} {what}" for name, what in COMMANDS.items()), err=True)
        elif word in ("/reset", "/clear"):
            self.history, self.attached = _messages(None, self.system), []
            kept = " (the system prompt stays)" if self.system else ""
            click.echo(f"Cleared the conversation{kept}.", err=True)
        elif word == "/image":
            self.attached += _attach(rest)
        elif word == "/system":
            self._set_system(rest)
        elif word == "/save":
            _save(self.history, rest)
        else:
            click.secho(f"Unknown command {word}; /help lists the commands.", err=True, fg="red")
        return True

    def _set_system(self, text: str) -> None:
        if not text:
            click.echo(f"System prompt: {self.system}" if self.system else "No system prompt; /system TEXT sets one.",
                       err=True)  # fmt: skip
            return
        self.system = text
        turns = [m for m in self.history if m["role"] != "system"]
        self.history = [{"role": "system", "content": text}, *turns]
        click.echo("Set the system prompt; it applies from your next message.", err=True)


def _read_line() -> str | None:
    """The next line typed at the prompt; None at the end of input (Ctrl-D). Ctrl-C at the prompt only says how
    to quit (it stops answers; typed here, it would end the chat with nothing said)."""
    while True:
        click.echo(">>>", nl=False)
        try:
            return termui.visible_prompt_func(" ")  # looked up now: click's test runner replaces it
        except EOFError:
            click.echo(err=True)
            return None
        except KeyboardInterrupt:
            click.echo("\n(Ctrl-C stops an answer; /bye or Ctrl-D quits.)", err=True)


def _save(history: list[dict[str, Any]], path: str) -> None:
    """`/save FILE`: the conversation as JSON in a new file (an existing one is never overwritten)."""
    if not path:
        click.secho("Usage: /save FILE", err=True, fg="red")
        return
    target = Path(path).expanduser()
    try:
        with target.open("x", encoding="utf-8") as out:
            json.dump({"messages": history}, out, ensure_ascii=False, indent=2)
    except FileExistsError:
        click.secho(f"Error: {target} exists; /save writes a new file: name another", err=True, fg="red")
        return
    except OSError as e:
        click.secho(f"Error: cannot write {target}: {e.strerror or e}", err=True, fg="red")
        return
    click.echo(f"Saved {len(history)} messages to {target}.", err=True)


def _model_for(model: str | None, local: bool, dtype: str | None, quiet: bool, **options: Any) -> Model | RemoteModel:
    """The resident server's model when a server runs (no second copy of the weights), else one loaded here.

    Options that change how a model loads (--dtype, --kv-bits, a draft model, a speculation mode, an adapter)
    load it here: the server's copy was loaded with its own."""
    loads_here = local or dtype or options["kv_bits"] or options["draft_model"] or options["speculate"] != "auto"
    loads_here = loads_here or bool(options["adapters"])
    server = None if loads_here else find_server()
    if server is None:
        llm = load_model(model, dtype, quiet, **options)
        record_use(llm.path)  # `mlxinfer ls` shows when each model was last used
        return llm
    if not quiet:
        click.echo(f"Using the mlxinfer server at {server.url} (pid {server.pid}); --local loads it here", err=True)
    remote = RemoteModel(server, model_field(model))
    remote.name = remote.name or next(iter(server_identity(server).get("models", [])), None)  # the server's first
    return remote


def _model_facts(llm: Model | RemoteModel) -> dict[str, Any]:
    if isinstance(llm, RemoteModel):
        return {"model": llm.name, "server": llm.server.url}
    return {"model": str(llm.path), "architecture": llm.architecture, "verified": llm.verified}


def _stream_answer(llm: Model | RemoteModel, history: list[dict[str, str]], options: dict[str, Any]) -> str:
    run = llm.stream(history, chat=True, **options)
    parts: list[str] = []
    stopped = False
    try:
        for chunk in run:
            parts.append(chunk)
            click.echo(chunk, nl=False)
    except KeyboardInterrupt:
        if isinstance(run, RemoteStream):  # the server stops it, and its end brings the true counts
            run.stop()
            click.echo(run.text()[len("".join(parts)) :], nl=False)  # the text that was on its way
            parts = [run.text()]
        click.echo(" [stopped]", nl=False)
        stopped = True
    click.echo()
    if stopped and isinstance(llm, RemoteModel) and not run.stats.prompt_tokens:
        # The stop did not reach the server (it is gone or too old to know it): say so, not zeros.
        click.secho(f"stopped after {run.stats.total_s:.2f} s; the server sent no token counts",
                    err=True, dim=True)  # fmt: skip
    else:
        click.secho(run.stats.summary(), err=True, dim=True)
    return "".join(parts)


def _messages(text: str | None, system: str | None, images: Sequence[str] = ()) -> list[dict[str, Any]]:
    """A chat's opening: the system prompt, then the user's text with `images` (data: URLs) before it."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    if text is not None and images:
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
        messages.append({"role": "user", "content": [*parts, {"type": "text", "text": text}]})
    elif text is not None:
        messages.append({"role": "user", "content": text})
    return messages


def _attach(path: str) -> list[str]:
    """`/image FILE`: the image as a data: URL for the next message, or an error line and nothing."""
    if not path:
        click.secho("Usage: /image FILE (then ask about it)", err=True, fg="red")
        return []
    try:
        url = file_data_url(path, "/image")
    except ImageError as e:
        click.secho(f"Error: {e}", err=True, fg="red")
        return []
    click.echo(f"Attached {Path(path).name}; your next message asks about it.", err=True)
    return [url]


def _structure_options(schema_file: Path | None, regex: str | None, choice: tuple[str, ...]) -> dict[str, Any]:
    """Model.stream's keyword for --schema, --regex or --choice (at most one), checked before the load."""
    given = {"schema": schema_file, "regex": regex, "choices": list(choice) or None}
    given = {name: value for name, value in given.items() if value is not None}
    if len(given) > 1:
        flags = " and ".join(f"--{'choice' if name == 'choices' else name}" for name in given)
        raise click.UsageError(f"{flags} were given together; an answer follows one constraint: keep one")
    if schema_file is not None:
        given["schema"] = _read_schema(schema_file)
    try:
        structure_of(**given)
    except GrammarError as e:
        raise click.ClickException(f"{schema_file}: {e}" if schema_file else str(e)) from None
    return given


def _read_schema(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, read no further than a schema may be long (real ones are a few KB)."""
    try:
        size = path.stat().st_size
    except OSError:
        size = 0  # missing or unreadable: read_json_object names the problem
    if size > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{path}: {size:,} bytes; a schema file may have at most {MAX_GRAMMAR_CHARS:,}")
    return read_json_object(path, GrammarError, limit=MAX_GRAMMAR_CHARS)
