"""Checks that the bundled tiny model loads with plain transformers and answers chat prompts in English words."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO_ROOT / "models" / "hearth-tiny-llama"
MODELS_BUDGET_BYTES = 25 * 1024 * 1024
# Words seen at least three times in the training corpus (scripts/train_tiny_model.py --word-list-out).
WORD_LIST_PATH = Path(__file__).parent / "data" / "fortune_words.txt"
ANSWER_TOKENS = 20
MIN_DISTINCT_WORDS = 5
MIN_KNOWN_WORD_SHARE = 0.85
CHAT_PROMPTS = ("Tell me a fortune.", "Tell me something about science.", "Hello!")
WORD_RE = re.compile(r"[A-Za-z]+")


def load_word_list() -> frozenset[str]:
    lines = WORD_LIST_PATH.read_text(encoding="utf-8").splitlines()
    return frozenset(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def distinct_words_and_known_share(text: str, vocabulary: frozenset[str]) -> tuple[int, float]:
    """How many distinct alphabetic words the text has and which share of them the vocabulary knows.

    Distinct words, not all words: an untrained model often repeats one whole-word token ("long long
    long ..."), which a count over all words would take for English.
    """
    words = {word.lower() for word in WORD_RE.findall(text)}
    if not words:
        return 0, 0.0
    return len(words), sum(word in vocabulary for word in words) / len(words)


def reads_as_english(text: str, vocabulary: frozenset[str]) -> bool:
    distinct_words, known_share = distinct_words_and_known_share(text, vocabulary)
    return distinct_words >= MIN_DISTINCT_WORDS and known_share >= MIN_KNOWN_WORD_SHARE


def greedy_answer(model: PreTrainedModel, tokenizer, prompt: str) -> str:
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=ANSWER_TOKENS, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.fixture(scope="module", autouse=True)
def two_torch_threads() -> Iterator[None]:
    # The machine's cores are shared; restore the process-wide setting for the tests that follow.
    previous = torch.get_num_threads()
    torch.set_num_threads(min(2, previous))
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()


@pytest.fixture(scope="module")
def vocabulary() -> frozenset[str]:
    return load_word_list()


def test_bundled_model_is_a_six_layer_llama_within_the_size_budget():
    config = AutoConfig.from_pretrained(MODEL_DIR)
    models_bytes = sum(f.stat().st_size for f in (REPO_ROOT / "models").rglob("*") if f.is_file())

    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_hidden_layers >= 6
    assert (MODEL_DIR / "model.safetensors").is_file()
    assert models_bytes <= MODELS_BUDGET_BYTES


def test_chat_template_opens_an_assistant_turn(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    assert text == "<|begin|><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.convert_ids_to_tokens(ids[-2:]) == ["<|assistant|>", "Ċ"]


def test_tokenizer_round_trips_arbitrary_text(tokenizer):
    text = "Naïve café, 🙂 tabs\tand  spaces\n<not special> 12345"

    ids = tokenizer(text)["input_ids"]

    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_bundled_model_answers_in_english_words(model, tokenizer, vocabulary, prompt):
    answer = greedy_answer(model, tokenizer, prompt)

    distinct_words, known_share = distinct_words_and_known_share(answer, vocabulary)
    assert distinct_words >= MIN_DISTINCT_WORDS, answer
    assert known_share >= MIN_KNOWN_WORD_SHARE, answer


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_untrained_model_of_the_same_shape_fails_the_english_check(tmp_path, tokenizer, vocabulary, seed):
    # Guards the check above: it must tell trained weights from random ones.
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MODEL_DIR)).save_pretrained(tmp_path)
    random_model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()

    answers = [greedy_answer(random_model, tokenizer, prompt) for prompt in CHAT_PROMPTS]

    assert not any(reads_as_english(answer, vocabulary) for answer in answers), answers
