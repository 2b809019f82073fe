"""verl's real agent loop on a CPU, for the FlexFloor router's test: stand-in rollout servers.

What runs for real around these: verl 0.9.1's ``AgentLoopManager``, its ``AgentLoopWorker``
Ray actors, ``SingleTurnAgentLoop`` (the prompt built by verl's Continuous Token path with a
real Hugging Face tokenizer), ``LLMServerClient`` and the router verl builds from a router YAML
(``verl.workers.rollout.router.get_router_handle``). The stand-ins are the GPU parts: each
rollout server (verl's ``vLLMHttpServer`` actor) is a :class:`ScriptedServer` that answers
``generate`` as verl's servers do (a ``TokenOutput``) with a scripted number of tokens, and
the model is a tiny tokenizer and config on disk (:func:`tiny_model`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from verl.workers.rollout.replica import TokenOutput

WORDS = 64
"""Words of the tiny vocabulary (``w0`` ... ``w63``): a prompt of k words is k tokens (the
chat template adds none)."""
EOS_ID = 2


def tiny_model(folder: Path) -> Path:
    """Write a tiny Hugging Face model folder (tokenizer + config, no weights); returns it.

    A word-level tokenizer on whitespace (``[PAD]`` 0, ``[UNK]`` 1, ``</s>`` 2, then the words)
    whose chat template joins the messages' contents, and a 1-layer Llama config.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415 - verl venv only
    from transformers import LlamaConfig, PreTrainedTokenizerFast  # noqa: PLC0415

    vocab = {"[PAD]": 0, "[UNK]": 1, "</s>": EOS_ID}
    vocab.update({f"w{i}": 3 + i for i in range(WORDS)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="[PAD]",
        unk_token="[UNK]",
        eos_token="</s>",
        chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}",
    )
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}))
    return folder


def prompt_words(k: int, tag: int) -> str:
    """A prompt of ``k`` tokens, distinct per ``tag``."""
    return " ".join(f"w{(tag + i) % WORDS}" for i in range(k))


class ScriptedServer:
    """A rollout server as verl's agent loop calls it (``generate`` -> ``TokenOutput``).

    Args:
        name: its id (verl's server address).
        response_tokens: prompt length (tokens) -> response length (tokens) it generates.
    """

    def __init__(self, name: str, response_tokens: dict[int, int]) -> None:
        self.name = name
        self.response_tokens = response_tokens
        self.calls: list[tuple[int, int]] = []

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        **_: Any,
    ) -> TokenOutput:
        """Generate the scripted number of tokens for a prompt of this length."""
        del request_id, sampling_params
        n = self.response_tokens[len(prompt_ids)]
        self.calls.append((len(prompt_ids), n))
        return TokenOutput(
            token_ids=[3 + (i % WORDS) for i in range(n)],
            log_probs=[0.0] * n,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": 0},
        )

    def requests(self) -> list[tuple[int, int]]:
        """(prompt tokens, response tokens) of every request served, in order."""
        return list(self.calls)


def agent_loop_config(
    model: Path, *, workers: int, prompt_tokens: int, response_tokens: int
) -> DictConfig:
    """The default trainer config of verl for a single-turn agent loop over ``model``.

    Args:
        model: :func:`tiny_model`'s folder.
        workers: agent-loop workers (``rollout.agent.num_workers``).
        prompt_tokens: ``rollout.prompt_length`` (and ``data.max_prompt_length``).
        response_tokens: ``rollout.response_length`` (and ``data.max_response_length``).
    """
    import verl.trainer.config  # noqa: PLC0415 - verl venv only

    generated = Path(verl.trainer.config.__file__).parent / "_generated_ppo_trainer.yaml"
    config = OmegaConf.load(generated)
    OmegaConf.update(config, "actor_rollout_ref.model.path", str(model))
    OmegaConf.update(config, "actor_rollout_ref.rollout.name", "vllm")
    OmegaConf.update(config, "data.max_prompt_length", prompt_tokens)
    OmegaConf.update(config, "data.max_response_length", response_tokens)
    OmegaConf.update(config, "actor_rollout_ref.rollout.agent.num_workers", workers)
    OmegaConf.update(config, "actor_rollout_ref.rollout.prompt_length", prompt_tokens)
    OmegaConf.update(config, "actor_rollout_ref.rollout.response_length", response_tokens)
    assert isinstance(config, DictConfig)
    return config


__all__ = ["ScriptedServer", "agent_loop_config", "prompt_words", "tiny_model"]
