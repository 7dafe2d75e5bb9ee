"""Chat templates, rendered the way transformers' ``apply_chat_template`` renders them.

A checkpoint's template is Jinja2 (``tokenizer_config.json`` ``chat_template``, a
``chat_template.jinja`` file, or GGUF ``tokenizer.chat_template``; ``engine.loader``
reads it). transformers renders it in a sandbox with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that leaves
non-ASCII and HTML characters alone, the globals ``raise_exception`` and
``strftime_now``, and the tokenizer's named special tokens (``bos_token``,
``eos_token``, ...) as variables; so does this module. The template is untrusted code
from the checkpoint, hence the sandbox.
"""

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged.

    transformers uses the tag to mark assistant text for training masks; a template
    that has it must still parse here.
    """

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(template):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(template, messages, *, special_tokens, add_generation_prompt=True):
    """The text of ``messages`` (a list of ``{"role": ..., "content": ...}`` dicts).

    ``special_tokens`` maps names (``bos_token``, ``eos_token``, ...) to the token
    strings the template may use. A template's ``raise_exception("...")`` raises
    ``jinja2.TemplateError`` with that message.
    """
    if (
        isinstance(messages, (str, dict))
        or not messages
        or not all(isinstance(m, dict) and "role" in m for m in messages)
    ):
        raise ValueError(
            'messages: expected a non-empty list of {"role": ..., "content": ...} '
            f"dicts, got {messages!r:.200}"
        )
    return _compile(template).render(
        messages=list(messages),
        tools=None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **special_tokens,
    )


def chat_prompt(llm, messages, add_generation_prompt, tokenize):
    """``LLM.apply_chat_template``: ``messages`` rendered with ``llm``'s chat template, or
    with ``tokenize`` its token ids (special tokens in the text become their ids; the
    tokenizer adds nothing, the template writes any BOS)."""
    if llm.chat_template is None:
        raise ValueError(
            f"{llm.source}: the checkpoint has no chat template (HF: chat_template in "
            f"tokenizer_config.json or chat_template.jinja; GGUF: tokenizer.chat_template)"
        )
    if tokenize and llm.tokenizer is None:
        raise ValueError(f"{llm.source}: tokenize=True needs a tokenizer; there is none")
    text = render_chat(
        llm.chat_template,
        messages,
        special_tokens=llm.special_tokens,
        add_generation_prompt=add_generation_prompt,
    )
    if not tokenize:
        return text
    return llm.tokenizer.encode(text, add_special_tokens=False).ids
