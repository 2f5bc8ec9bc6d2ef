"""Head: tokenization, chat templates, logits (Gemma 2 soft-capping), sampling, streamed text with stops."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hearth.inference import FINISH_LENGTH, FINISH_STOP, SamplingParams, TextStream, load_head, sample_token

from .inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)

MULTI_BYTE_TEXT = "grüße aus köln 🔥🙂 東京 naïve café"
BOS_ID, EOS_ID = 1, 2


@pytest.fixture(scope="module")
def head(tiny_model_dir):
    return load_head(tiny_model_dir("llama"))


# ----------------------------------------------------------------------------- tokenization


def test_raw_prompt_is_tokenized_exactly_as_the_tokenizer_does(head):
    ids = head.encode_prompt("hello there")
    assert ids == head.tokenizer("hello there")["input_ids"]
    assert ids[0] == BOS_ID  # this tokenizer's post-processor adds BOS, and the raw mode keeps it


def test_chat_messages_go_through_the_chat_template_with_the_generation_prompt(head):
    messages = [{"role": "user", "content": "hello there"}]
    ids = head.encode_chat(messages)
    assert head.tokenizer.decode(ids) == "<s><|user|>hello there</s><|assistant|>"
    without_prompt = head.encode_chat(messages, add_generation_prompt=False)
    assert ids[: len(without_prompt)] == without_prompt and len(ids) > len(without_prompt)


@pytest.mark.parametrize("messages", [[], [{"role": "user"}], [{"role": "user", "content": 3}], ["hi"]])
def test_malformed_messages_are_rejected(head, messages):
    with pytest.raises(ValueError, match="messages"):
        head.encode_chat(messages)


def test_eos_ids_come_from_the_model_and_requests_add_their_own(head):
    assert head.eos_token_ids == {EOS_ID}
    assert head.stop_token_ids(SamplingParams(stop_token_ids=[7, 9])) == {EOS_ID, 7, 9}


# ----------------------------------------------------------------------------- tensors


def test_embed_validates_token_ids(head):
    assert head.embed([1, 2, 3]).shape == (1, 3, head.info.hidden_size)
    with pytest.raises(ValueError, match="token ids"):
        head.embed([head.info.vocab_size])
    with pytest.raises(ValueError, match="empty"):
        head.embed([])


def test_logits_use_only_the_last_position(head):
    hidden = head.embed([1, 2, 3, 4])
    changed_earlier = hidden.clone()
    changed_earlier[0, :3] += 1.0
    assert torch.equal(head.logits(hidden), head.logits(changed_earlier))
    assert torch.equal(head.logits(hidden), head.logits(hidden[:, -1:]))


def test_gemma2_logits_are_soft_capped(tiny_model_dir):
    gemma = load_head(tiny_model_dir("gemma2"))
    cap = 3.0  # final_logit_softcapping of the tiny Gemma 2 config
    hidden = torch.randn(1, 1, gemma.info.hidden_size, generator=torch.Generator().manual_seed(0)) * 50
    logits = gemma.logits(hidden)
    assert logits.abs().max() <= cap
    assert logits.abs().max() > 0.9 * cap  # big activations really reach the cap


# ----------------------------------------------------------------------------- sampling


LOGITS = torch.tensor([0.5, 3.0, 2.9, 2.8, -1.0, 0.0, 1.0, 2.0])


def draw(params: SamplingParams, count: int = 200) -> list[int]:
    generator = params.make_generator()
    return [sample_token(LOGITS, params, generator) for _ in range(count)]


def test_greedy_is_argmax_whatever_the_filters_say():
    assert set(draw(SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=3), 20)) == {1}


def test_a_seed_makes_sampling_reproducible():
    params = SamplingParams(temperature=1.0, seed=1234)
    assert draw(params) == draw(params)
    assert draw(params) != draw(SamplingParams(temperature=1.0, seed=4321))
    assert len(set(draw(params))) > 3  # really sampling, not argmax


def test_top_k_keeps_only_the_k_best():
    assert set(draw(SamplingParams(temperature=5.0, top_k=3, seed=0))) == {1, 2, 3}
    assert set(draw(SamplingParams(temperature=5.0, top_k=1, seed=0))) == {1}


def test_top_p_keeps_the_smallest_set_over_p():
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.01, seed=0))) == {1}
    drawn = set(draw(SamplingParams(temperature=1.0, top_p=0.6, seed=0)))
    assert drawn == {1, 2, 3}  # softmax mass of tokens 1,2,3 crosses 0.6 only with all three


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_tokens": 0}, {"stop": [""]}],
)
def test_invalid_sampling_params_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


# ----------------------------------------------------------------------------- streamed text


def stream_all(stream: TextStream, token_ids):
    deltas = []
    for token_id in token_ids:
        deltas.append(stream.push(token_id))
        if deltas[-1].finished:
            return deltas
    deltas.append(stream.finish())
    return deltas


def test_multi_byte_characters_split_over_tokens_stream_without_garbage(head):
    ids = head.tokenizer(MULTI_BYTE_TEXT, add_special_tokens=False)["input_ids"]
    per_token = [head.tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in per_token)  # the naive way would emit broken characters
    deltas = stream_all(head.text_stream(SamplingParams()), ids)
    assert "".join(d.text for d in deltas) == MULTI_BYTE_TEXT
    assert all("\ufffd" not in d.text for d in deltas)
    assert any(d.text == "" for d in deltas[:-1])  # some tokens had to wait for the rest of a character
    assert deltas[-1].finish_reason == FINISH_LENGTH


@pytest.mark.parametrize("text", ["naïve café", "東京", "🔥🙂"])
def test_an_answer_cut_in_the_middle_of_a_character_ends_before_it_not_in_a_replacement_character(head, text):
    """max_tokens may end an answer after some of a character's bytes: its text ends with the characters before
    that one, never with a U+FFFD for the bytes that came, and the stream still ends `length`."""
    ids = head.tokenizer(text, add_special_tokens=False)["input_ids"]
    cuts = [cut for cut in range(1, len(ids)) if head.tokenizer.decode(ids[:cut]).endswith("\ufffd")]
    assert cuts, "no token boundary falls inside a character"
    for cut in cuts:
        deltas = stream_all(head.text_stream(SamplingParams()), ids[:cut])
        visible = "".join(d.text for d in deltas)
        assert "\ufffd" not in visible, (cut, visible)
        assert text.startswith(visible) and len(visible) == len(head.tokenizer.decode(ids[:cut]).rstrip("\ufffd"))
        assert deltas[-1].finish_reason == FINISH_LENGTH


def test_stop_string_spanning_tokens_ends_the_text_before_it(head):
    text = "hello there, the quick brown fox"
    ids = head.tokenizer(text, add_special_tokens=False)["input_ids"]
    stop = "e, the q"
    deltas = stream_all(head.text_stream(SamplingParams(stop=["zebra", stop])), ids)
    visible = "".join(d.text for d in deltas)
    assert visible == text[: text.index(stop)]
    assert deltas[-1].finished and deltas[-1].finish_reason == FINISH_STOP
    assert len(deltas) < len(ids)  # it stopped early
    shown = ""
    for delta in deltas:  # a prefix of the stop string was never shown before being confirmed harmless
        shown += delta.text
        assert stop not in shown


def test_text_that_only_looked_like_a_stop_string_is_released(head):
    ids = head.tokenizer("the quick", add_special_tokens=False)["input_ids"]
    deltas = stream_all(head.text_stream(SamplingParams(stop=["quiet", "quickly"])), ids)
    assert "".join(d.text for d in deltas) == "the quick"
    assert deltas[-1].finish_reason == FINISH_LENGTH


def test_stop_token_ends_the_stream_without_its_text(head):
    ids = head.tokenizer("hello there", add_special_tokens=False)["input_ids"]
    deltas = stream_all(head.text_stream(SamplingParams()), [*ids, EOS_ID, *ids])
    assert "".join(d.text for d in deltas) == "hello there"
    assert deltas[-1].token_id == EOS_ID and deltas[-1].finish_reason == FINISH_STOP
    assert len(deltas) == len(ids) + 1


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer: a token's leading space is dropped when it starts the decoded text."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tokenizer.train_from_iterator(["hello there general kenobi"] * 3, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_prompt_context_keeps_the_first_generated_space():
    tokenizer = metaspace_tokenizer()
    ids = tokenizer("hello there", add_special_tokens=False)["input_ids"]
    prompt_ids, generated = ids[:1], ids[1:]
    assert tokenizer.decode(generated) == "there"  # decoded alone, the space is lost
    with_context = stream_all(TextStream(tokenizer, prompt_ids=prompt_ids), generated)
    assert "".join(d.text for d in with_context) == " there"
