"""vLLM's request extensions beyond the ones the sampling rules list, each with its rule. Pure.

A client moving from vLLM sends these. An unknown field is ignored (with a log line), which for
these would change the answer without a word to the client: beam search answered by sampling.
So each one acts, or is accepted at the value that changes nothing and is otherwise a 400 naming
it, or is refused, or is listed as ignored because by its nature it changes nothing here
(`fields_base.Support`).
"""

from __future__ import annotations

from trtdisagg.api.fields_base import IGNORED, NEUTRAL, REFUSED, SUPPORTED, FieldRule, rule


def vllm_rules(*, chat: bool) -> list[FieldRule]:
    """The rules of both generation routes, and chat's own (`chat`)."""
    rules = [
        rule(
            "truncation_side",
            SUPPORTED,
            "extension (vLLM's): which end `truncate_prompt_tokens` keeps: `left` (the "
            "default) cuts from the left and keeps the prompt's last tokens, `right` its first",
            bad="middle",
        ),
        rule(
            "stream_interval",
            SUPPORTED,
            "extension (vLLM's): a stream's chunks carry at least this many tokens each after "
            "the first (the last goes out at once); below the server's `stream_interval` it is "
            "raised to it",
            bad=0,
        ),
        rule(
            "session_id",
            SUPPORTED,
            "extension (vLLM's): a session's requests go to one server, as `conversation_id`'s "
            "do (which wins when both are given)",
        ),
        rule(
            "use_beam_search",
            NEUTRAL,
            "extension (vLLM's): false only; beam search is not served (`best_of` ranks "
            "sampled candidates)",
            neutral=(False,),
            bad=True,
        ),
        rule(
            "length_penalty",
            NEUTRAL,
            "extension (vLLM's): beam search's; 1 only",
            neutral=(1,),
            bad=0.5,
        ),
        rule(
            "logprob_token_ids",
            SUPPORTED,
            "extension (vLLM's): 1 to 20 token ids; with `logprobs` (chat: `logprobs: true`) "
            "each output token's alternatives are these tokens' logprobs, in this order, "
            "instead of the most likely (a classifier's labels, scored at every token)",
            bad=[],
        ),
        rule(
            "logits_processors",
            REFUSED,
            "extension (vLLM's): a worker runs no code a request names",
            bad=["x"],
        ),
        rule(
            "prompt_embeds",
            REFUSED,
            "extension (vLLM's): a prompt is text or token ids",
            bad="AAAA",
        ),
        rule(
            "kv_transfer_params",
            REFUSED,
            "extension (vLLM's): its prefill/decode hand-over; here `disaggregated_params` "
            "(see Disaggregated parameters)",
            bad={"do_remote_decode": True},
        ),
        rule(
            "repetition_detection",
            REFUSED,
            "extension (vLLM's): an answer is not cut short on repeated n-grams here",
            bad={"min_ngram": 2},
        ),
        rule(
            "thinking_token_budget",
            NEUTRAL,
            "extension (vLLM's): -1 only (no budget); a reasoning model's thinking is not told "
            "apart from its answer here",
            neutral=(-1,),
            bad=128,
        ),
        rule(
            "guided_whitespace_pattern",
            REFUSED,
            "extension (vLLM's): JSON output's whitespace follows llguidance's own rule",
            bad="[ ]?",
        ),
        rule(
            "guided_decoding_backend",
            IGNORED,
            "extension (vLLM's): the grammar engine is llguidance whichever is named",
        ),
        rule(
            "vllm_xargs",
            IGNORED,
            "extension (vLLM's): arguments of vLLM's custom extensions; none run here",
        ),
    ]
    if chat:
        rules += [
            rule(
                "documents",
                SUPPORTED,
                "extension (vLLM's): the chat template's `documents` variable (a retrieval "
                "template reads it, others do not)",
                bad="not a list",
            ),
            rule(
                "include_reasoning",
                SUPPORTED,
                "extension (vLLM's): false drops a reasoning model's thinking from the answer "
                "(see Reasoning)",
                bad="no",
            ),
            rule(
                "mm_processor_kwargs",
                IGNORED,
                "extension (vLLM's): for multimodal processors; messages here are text",
            ),
        ]
    return rules
