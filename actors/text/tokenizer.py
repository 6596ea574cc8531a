"""Tokenizers and chat templates, from a GGUF file's metadata or a Hugging Face folder.

Both end up as a `tokenizers.Tokenizer` plus the chat template and special token ids that
came with the model; nothing is downloaded.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer as Backend, decoders, models, pre_tokenizers

from sluice.ipc.vocabulary import InvalidParams
from sluice.actors.text.detokenizer import ByteVocabulary

# how llama.cpp names the pre-tokenizer of a byte-level vocabulary -> the split it stands for
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT}
_CONTROL = 3  # llama.cpp token type of special tokens such as <|im_end|>
# The tokenizers library holds the GIL through `encode` but releases it in `encode_batch`:
# a long text goes through the batch call, so that tokenizing it on a worker thread does not
# stop the event loop (about half a second per megabyte here). Short texts take the cheaper
# single call.
_RELEASE_GIL_CHARS = 4096


class Tokenizer:
    def __init__(self, backend: Backend, *, eos_token_ids: frozenset[int],
                 bos_token_id: int | None = None, add_bos: bool = False,
                 chat_template: str | None = None):
        self.backend = backend
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._template = None
        self._token_texts: dict[int, str] = {}  # at most one entry per vocabulary token
        self._byte_vocabulary: ByteVocabulary | None | bool = False  # False: not built yet
        self._specials: dict[int, str] | None = None  # special token id -> its spelling
        self._special_re: re.Pattern | None | bool = False  # False: not built yet
        self._plain: Backend | None = None  # matches no special token (`_plain_backend`)

    def encode(self, text: str) -> list[int]:
        _check_text("prompt", text)
        ids = self._encode_ids(text)
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text alone, special tokens spelled out (what logprobs name it by)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.backend.decode([token_id], skip_special_tokens=False)
            if 0 <= token_id < self.vocab_size:
                self._token_texts[token_id] = text
        return text

    def byte_vocabulary(self) -> ByteVocabulary | None:
        """Each token's bytes, as decoding joins them before reading them as UTF-8 (b"" for a
        special token, which decoding skips): what a detokenizer streams from without a call
        into the tokenizers library per token. None unless the vocabulary is byte-level and
        every token alone decodes from its bytes exactly as the library decodes it. Built on
        first use (a fifth of a second for a 50k vocabulary here), then kept."""
        if self._byte_vocabulary is False:
            pieces = _byte_table(self.backend)
            self._byte_vocabulary = None if pieces is None else ByteVocabulary(pieces)
        return self._byte_vocabulary

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The template's text for `messages`. `tools` (OpenAI's list of functions) reach the
        template as its `tools` variable, as transformers passes them; a template that never
        reads `tools` gets them in a system preamble instead, asking for Hermes-style
        `<tool_call>` blocks, and one that never reads `tool_calls` gets an assistant's calls
        and the `tool` turns' results as plain text in the messages (`with_tools`)."""
        _check_messages(messages)
        if self.chat_template is None:
            raise InvalidParams("messages", "this model has no chat template")
        from jinja2.exceptions import TemplateError

        messages, tools = with_tools(self.chat_template, messages, tools)
        token = self.backend.id_to_token
        try:
            if self._template is None:
                self._template = _compile_template(self.chat_template)
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=token(self.bos_token_id) if self.bos_token_id is not None else "",
                eos_token=token(min(self.eos_token_ids)) if self.eos_token_ids else "",
            )
        except TemplateError as exc:  # `raise_exception`: roles that do not alternate, ...
            raise InvalidParams("messages", "the model's chat template refused them: "
                                f"{_clipped(str(exc))}") from None
        except Exception as exc:  # the template's own code failed on these messages
            raise InvalidParams("messages", "the model's chat template failed on them: "
                                f"{type(exc).__name__}: {_clipped(str(exc))}") from None

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The template's text, tokenized. The template writes any BOS itself, and its special
        tokens are matched whole; a message's role and content are plain text: where one
        spells a special token (`<|im_end|>`) it is tokenized as the characters it is, so a
        message can never close its turn or open another (a forged system prompt)."""
        pattern = self._special_pattern()
        spelled: dict[str, str] = {}  # placeholder -> the special token's spelling it stands for
        if pattern is not None:
            nonce = f"\ue000{secrets.randbelow(10**12):012d}:"

            def hide(match: re.Match) -> str:
                placeholder = f"{nonce}{len(spelled)}\ue001"
                spelled[placeholder] = match.group()
                return placeholder

            _check_messages(messages)
            messages, tools = with_tools(self.chat_template or "", messages, tools)
            messages = [{**message, "role": pattern.sub(hide, message["role"]),
                         "content": pattern.sub(hide, message["content"])}
                        for message in messages]
            messages = [{**message, "tool_calls": json.loads(pattern.sub(
                            hide, json.dumps(message["tool_calls"])))}
                        if message.get("tool_calls") else message for message in messages]
            messages = [{**message, "tool_call_id": pattern.sub(hide, message["tool_call_id"])}
                        if message.get("tool_call_id") else message for message in messages]
            if tools is not None:  # a template's own rendering of them: no special tokens
                tools = json.loads(pattern.sub(hide, json.dumps(tools)))
        text = self.apply_chat_template(messages, tools=tools)
        if not spelled:
            return self._encode_ids(text)
        return self._encode_spelled(text, nonce, spelled)

    def _encode_spelled(self, text: str, nonce: str, spelled: dict[str, str]) -> list[int]:
        """`text` tokenized where its placeholders (each begins with `nonce`) stand for special
        tokens' spellings: the stretches between two of the template's special tokens that
        hold a placeholder are tokenized again, placeholders spelled out, with no special
        token matched."""
        encoding = self._encoding(self.backend, text)
        ids, offsets = encoding.ids, encoding.offsets
        special = self._special_ids()
        result: list[int] = []
        run = 0  # the first token of the stretch since the last special token
        for i in range(len(ids) + 1):
            if i < len(ids) and ids[i] not in special:
                continue
            start = offsets[run - 1][1] if run else 0
            end = offsets[i][0] if i < len(ids) else len(text)
            stretch = text[start:end]
            if nonce in stretch:
                for placeholder, spelling in spelled.items():
                    stretch = stretch.replace(placeholder, spelling)
                result += self._encoding(self._plain_backend(), stretch).ids
            else:
                result += ids[run:i]
            if i < len(ids):
                result.append(ids[i])
            run = i + 1
        return result

    def _special_ids(self) -> frozenset[int]:
        if self._specials is None:
            self._specials = {i: token.content for i, token
                              in self.backend.get_added_tokens_decoder().items() if token.special}
        return frozenset(self._specials)

    def _special_pattern(self) -> re.Pattern | None:
        """What matches any special token's spelling (None for a vocabulary without any)."""
        if self._special_re is False:
            self._special_ids()
            spellings = sorted(set(self._specials.values()), key=len, reverse=True)
            self._special_re = (re.compile("|".join(map(re.escape, spellings)))
                                if spellings else None)
        return self._special_re

    def _plain_backend(self) -> Backend:
        """A copy of the backend that matches no special token: their spellings are text."""
        if self._plain is None:
            plain = Backend.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def _encode_ids(self, text: str) -> list[int]:
        return self._encoding(self.backend, text).ids

    @staticmethod
    def _encoding(backend: Backend, text: str):
        if len(text) > _RELEASE_GIL_CHARS:
            return backend.encode_batch([text], add_special_tokens=False)[0]
        return backend.encode(text, add_special_tokens=False)


TOOL_PREAMBLE = (
    "You may call one or more functions to help with the user's request. The functions, "
    "as JSON schemas:\n<tools>\n{tools}\n</tools>\nTo call a function, answer with a JSON "
    "object of its name and arguments between tags:\n"
    '<tool_call>{{"name": <function-name>, "arguments": <arguments-object>}}</tool_call>'
)


def with_tools(template: str, messages: list[dict],
               tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools a template is given. A template that reads `tools` takes
    them as they are; one that does not gets them as a system preamble (Hermes' format),
    merged into the first system message or put before the others. A template that does
    not read `tool_calls` gets each assistant's calls as `<tool_call>` blocks after its
    content, and each `tool` turn as a user turn of a `<tool_response>` block. Applied twice,
    the second time changes nothing."""
    if tools and "tools" not in template:
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        preamble = TOOL_PREAMBLE.format(tools=listed)
        if messages and messages[0].get("role") == "system":
            messages = [{**messages[0], "content": messages[0]["content"] + "\n\n" + preamble},
                         *messages[1:]]
        else:
            messages = [{"role": "system", "content": preamble}, *messages]
        tools = None
    if "tool_calls" not in template and any(
            message.get("tool_calls") or message.get("role") == "tool" for message in messages):
        plain = []
        for message in messages:
            message = dict(message)
            calls = message.pop("tool_calls", None)
            message.pop("tool_call_id", None)
            if calls:
                blocks = "".join(
                    "<tool_call>" + json.dumps(
                        {"name": call["function"]["name"],
                         "arguments": _arguments(call["function"]["arguments"])},
                        ensure_ascii=False) + "</tool_call>" for call in calls)
                message["content"] = (message["content"] + "\n" if message["content"]
                                      else "") + blocks
            if message["role"] == "tool":  # as a user turn, as Qwen's templates write it
                message["role"] = "user"
                message["content"] = f"<tool_response>{message['content']}</tool_response>"
            plain.append(message)
        messages = plain
    return messages, tools or None


def _arguments(text: str):
    """A call's `arguments` (a JSON string) as the value it spells, else the text itself."""
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidParams("messages", "must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidParams(f"messages[{i}]", "must be an object with role and content")
        for key in ("role", "content"):
            _check_text(f"messages[{i}].{key}", message.get(key))


def _check_text(field: str, text: object) -> None:
    if not isinstance(text, str):
        raise InvalidParams(field, "must be a string")
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError as exc:
            raise InvalidParams(field, f"holds a lone UTF-16 surrogate at character "
                                f"{exc.start}: not text") from None


def _clipped(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _compile_template(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent,
                                                                   ensure_ascii=False)
    return env.from_string(source)


def _byte_of_char() -> dict[str, int]:
    """The byte-level alphabet: the character each byte is spelled with in a vocabulary (GPT-2's
    scheme: printable Latin-1 stands for itself, every other byte for a character from 256 on),
    inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 256
    for b in range(256):
        if b not in chars:
            chars[b] = chr(extra)
            extra += 1
    return {char: b for b, char in chars.items()}


def _byte_table(backend: Backend) -> list[bytes] | None:
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
    byte_of = _byte_of_char()
    table = []
    for i in range(size):
        if i in special:
            table.append(b"")
            continue
        token = backend.id_to_token(i)
        if token is None:  # a hole in the ids
            return None
        if all(char in byte_of for char in token):
            table.append(bytes([byte_of[char] for char in token]))
        else:  # spelled outside the alphabet (an added token): its own UTF-8
            table.append(token.encode())
    alone = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=True)
    if any(piece.decode("utf-8", "replace") != text for piece, text in zip(table, alone)):
        return None
    return table


def load_tokenizer(model_path: str | Path) -> Tokenizer:
    path = Path(model_path)
    if path.is_dir():
        return _from_hf_folder(path)
    return _from_gguf(path)


def _from_gguf(path: Path) -> Tokenizer:
    from sluice.actors.executor.model_files import ModelLoadError, gguf_field, open_gguf

    reader = open_gguf(path)
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{path}: tokenizer type {kind!r} is not supported (byte-level BPE only)")
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    merges = gguf_field(reader, "tokenizer.ggml.merges") or []
    types = gguf_field(reader, "tokenizer.ggml.token_type") or []
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                 ignore_merges=False))
    pre = gguf_field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLITS)
    if pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"), byte_level])
    elif pre == "smollm":
        # SmolLM's own tokenizer splits every digit before the GPT-2 byte-level split
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types) if kind == _CONTROL]
    backend.add_special_tokens(special)
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    eot = gguf_field(reader, "tokenizer.ggml.eot_token_id")
    return Tokenizer(
        backend,
        eos_token_ids=frozenset(int(i) for i in (eos, eot) if i is not None),
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        add_bos=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=gguf_field(reader, "tokenizer.chat_template"),
    )


def _from_hf_folder(folder: Path) -> Tokenizer:
    from sluice.actors.executor.model_files import ModelLoadError

    file = folder / "tokenizer.json"
    if not file.is_file():
        raise ModelLoadError(f"{folder}: no tokenizer.json")
    backend = Backend.from_file(str(file))
    settings = _read_json(folder / "tokenizer_config.json")
    config = _read_json(folder / "config.json")
    generation = _read_json(folder / "generation_config.json")

    def token_id(value) -> int | None:
        if isinstance(value, dict):
            value = value.get("content")
        return backend.token_to_id(value) if isinstance(value, str) else None

    eos_ids = set()
    for source in (generation.get("eos_token_id"), config.get("eos_token_id")):
        if isinstance(source, int):
            eos_ids.add(source)
        elif isinstance(source, list):
            eos_ids.update(i for i in source if isinstance(i, int))
    named_eos = token_id(settings.get("eos_token"))
    if named_eos is not None:
        eos_ids.add(named_eos)
    template = settings.get("chat_template")
    template_file = folder / "chat_template.jinja"
    if template is None and template_file.is_file():
        template = template_file.read_text()
    bos = token_id(settings.get("bos_token"))
    return Tokenizer(backend, eos_token_ids=frozenset(eos_ids), bos_token_id=bos,
                     add_bos=bool(settings.get("add_bos_token", False)) and bos is not None,
                     chat_template=template if isinstance(template, str) else None)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
