"""The bundled model's byte-level BPE tokenizer and chat format, and the training texts written in that format."""

from __future__ import annotations

import os
import random

# Tokenizer training is parallel (rayon); pin it before `tokenizers` is imported so the merge order
# can never depend on scheduling.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from tiny_model.corpus import Fortune  # noqa: E402

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|begin|>"
EOS_TOKEN = "<|end|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS.values()]

# Every message is "<|role|>\n" + content + "<|end|>\n"; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

GENERIC_PROMPTS = (
    "Tell me a fortune.",
    "Say something wise.",
    "Tell me something.",
    "Tell me a story.",
    "Tell me a joke.",
    "Share a quote.",
    "Give me some advice.",
    "What do you think?",
    "Hello!",
    "Hi, who are you?",
    "Say something.",
    "Write a short poem.",
    "Can you say something funny?",
    "What is the meaning of life?",
    "I need a fortune cookie.",
)
TOPIC_PROMPTS = (
    "Tell me something about {topic}.",
    "Say something about {topic}.",
    "What do you know about {topic}?",
)
# File name -> topic phrase for the topic prompts; files without an entry only get generic prompts.
TOPICS = {
    "computers": "computers",
    "drugs": "drugs",
    "education": "education",
    "food": "food",
    "humorists": "humor",
    "kids": "kids",
    "law": "the law",
    "literature": "literature",
    "love": "love",
    "magic": "magic",
    "medicine": "medicine",
    "men-women": "men and women",
    "news": "the news",
    "people": "people",
    "pets": "pets",
    "politics": "politics",
    "riddles": "riddles",
    "science": "science",
    "songs-poems": "poems",
    "sports": "sports",
    "startrek": "Star Trek",
    "tao": "the Tao",
    "wisdom": "wisdom",
    "work": "work",
}
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are hearth, a small model that tells fortunes.",
    "You are a friendly assistant.",
)

def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer (every string round-trips) whose first ids are the special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # A raw prompt is tokenized like a plain-text training sample: it starts with <|begin|>.
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def wrap_tokenizer(tokenizer: Tokenizer, context_tokens: int) -> PreTrainedTokenizerFast:
    """The transformers tokenizer that `AutoTokenizer.from_pretrained` gives back after saving."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        chat_template=CHAT_TEMPLATE,
        model_max_length=context_tokens,
        clean_up_tokenization_spaces=False,
    )


def build_sample_texts(fortunes: list[Fortune], chat_fraction: float, rng: random.Random) -> list[str]:
    """Each fortune becomes one training text: a chat exchange (with probability chat_fraction) or plain."""
    texts = []
    for fortune in fortunes:
        if rng.random() >= chat_fraction:
            texts.append(f"{BOS_TOKEN}{fortune.text}{EOS_TOKEN}")
            continue
        topic = TOPICS.get(fortune.category)
        if topic is not None and rng.random() < 0.5:
            prompt = rng.choice(TOPIC_PROMPTS).format(topic=topic)
        else:
            prompt = rng.choice(GENERIC_PROMPTS)
        turns = []
        if rng.random() < 0.15:
            turns.append(("system", rng.choice(SYSTEM_PROMPTS)))
        turns += [("user", prompt), ("assistant", fortune.text)]
        body = "".join(f"{ROLE_TOKENS[role]}\n{content}{EOS_TOKEN}\n" for role, content in turns)
        texts.append(f"{BOS_TOKEN}{body}")
    return texts


def encode_samples(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of every sample; the texts carry their own special tokens, so none are added."""
    return [encoding.ids for encoding in tokenizer.encode_batch(texts, add_special_tokens=False)]
