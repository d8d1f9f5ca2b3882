"""`trellm generate` and `trellm chat`: stream tokens to the terminal."""
from __future__ import annotations

import argparse
import sys

from trellm.entrypoints.cli import engine_kwargs, sampling_params
from trellm.entrypoints.llm import LLM


def _stream(llm: LLM, prompt_ids: list[int], params) -> str:
    """Run one request, printing text as it grows; returns the final text."""
    engine = llm.engine
    rid = f"cli-{next(llm._ids)}"
    engine.add_request(rid, None, params, prompt_token_ids=prompt_ids)
    shown = 0
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")
    return text


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # bad values fail before the model loads
    llm = LLM(args.model, **engine_kwargs(args))
    tok = llm.get_tokenizer()
    if tok is None:
        raise ValueError("this model has no tokenizer, so it cannot take a text prompt")
    if args.chat:
        ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        ids = tok.encode(args.prompt)
    _stream(llm, ids, params)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = LLM(args.model, **engine_kwargs(args))
    tok = llm.get_tokenizer()
    if tok is None or tok.chat_template is None:
        raise ValueError("this model has no chat template")
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("trellm chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        ids = tok.encode_chat(messages)
        try:
            reply = _stream(llm, ids, params)
        except ValueError as e:  # e.g. the conversation outgrew the context
            print(f"trellm: error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})
    return 0
