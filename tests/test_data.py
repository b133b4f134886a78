"""Data: JSONL/Parquet prompt sets, malformed rows, templates, length filter, SFT pairs, the resumable
sampler, procedural generators and the offline character tokenizer (real transformers/tokenizers)."""

import json
import string
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_megatron.data import (
    DataError,
    PromptSampler,
    build_char_tokenizer,
    build_prompt_datasets,
    build_sft_dataset,
    generate_splits,
    load_prompt_datasets,
    load_sft_datasets,
    load_tokenizer,
)
from grpo_megatron.data.config import DataConfig
from grpo_megatron.data.generators import arithmetic
from grpo_megatron.data.tokenizer import DEMO_CHARS, DEMO_WORDS
from grpo_megatron.rewards.base import RewardSample
from grpo_megatron.rewards.countdown import countdown_reward
from grpo_megatron.rewards.exact_match import exact_match

DEMO_TOKENIZER = Path(__file__).resolve().parents[1] / "examples" / "demo"
CHARS = string.digits + string.ascii_letters + "+-*/()=,:.?!'\"[]{}<>|_ \n"
# A minimal chat template (jinja) for the chat-template tests: roles and contents, then "A:".
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_char_tokenizer(CHARS, out, words=DEMO_WORDS)
    return load_tokenizer(out)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def cfg_of(**kw) -> DataConfig:
    cfg = DataConfig(**kw)
    cfg.validate()
    return cfg


# ---- files --------------------------------------------------------------------------------


def test_jsonl_happy_path(tmp_path, tok):
    train = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": "1+2=", "answer": "3", "level": 1},
            "",  # blank lines are not rows
            {"prompt": "10+20=", "answer": 30, "metadata": {"numbers": [10, 20], "target": 30}},
        ],
    )
    evals = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "4+4=", "answer": "8"}])
    ds = load_prompt_datasets(cfg_of(train_path=str(train), eval_path=str(evals)), tok, seed=0)
    a, b = ds.train
    assert (a.prompt, a.answer, a.metadata) == ("1+2=", "3", {"level": 1})
    assert a.prompt_ids == tuple(tok("1+2=").input_ids) and a.prompt_ids[0] == tok.bos_token_id
    assert (b.answer, b.metadata) == (
        "30",
        {"numbers": [10, 20], "target": 30},
    )  # a number answer, metadata merged
    assert [r.prompt for r in ds.eval] == ["4+4="]
    assert (ds.train_stats.rows, ds.train_stats.kept, ds.eval_stats.rows) == (2, 2, 1)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + train.read_bytes())  # a byte-order mark before line 1
    assert [r.prompt for r in build_prompt_datasets(cfg_of(train_path=str(bom)), tok, 0)[0]] == [
        "1+2=",
        "10+20=",
    ]
    # num_train_prompts keeps the first rows; no eval_path means no eval set
    train_only, eval_none = build_prompt_datasets(cfg_of(train_path=str(train), num_train_prompts=1), tok, 0)
    assert [r.prompt for r in train_only] == ["1+2="] and eval_none == []


def test_parquet_happy_path_and_directory(tmp_path, tok):
    table = pa.table(
        {"question": ["1+1=", "2+2=", "3+3="], "gold": ["2", "4", "6"], "numbers": [[1, 1], [2, 2], [3, 3]]}
    )
    folder = tmp_path / "parts"
    folder.mkdir()
    pq.write_table(table.slice(0, 2), folder / "part-0.parquet")
    pq.write_table(table.slice(2, 1), folder / "part-1.parquet")
    write_jsonl(folder / "part-2.jsonl", [{"question": "4+4=", "gold": "8"}])
    (folder / "README.md").write_text("ignored")
    cfg = cfg_of(train_path=str(folder), prompt_key="question", answer_key="gold")
    train, _ = build_prompt_datasets(cfg, tok, 0)
    assert [(r.prompt, r.answer) for r in train] == [
        ("1+1=", "2"),
        ("2+2=", "4"),
        ("3+3=", "6"),
        ("4+4=", "8"),
    ]
    assert train[2].metadata == {"numbers": [3, 3]} and train[3].metadata == {}


MALFORMED = [
    ('{"prompt": "1+1=", "answer": "2"', "bad JSON"),
    ('["1+1=", "2"]', "a JSON list, not an object"),
    ('{"answer": "2"}', "no field 'prompt'"),
    ('{"prompt": 12, "answer": "2"}', "field 'prompt' is int"),
    ('{"prompt": "1+1="}', "no field 'answer'"),
    ('{"prompt": "1+1=", "answer": [2]}', "field 'answer' is list"),
    ('{"prompt": "   ", "answer": "2"}', "field 'prompt' is empty"),
    ('{"prompt": "1+1=\\u00e9", "answer": "2"}', "outside the tokenizer's vocabulary"),
]


@pytest.mark.parametrize("bad_row, reason", MALFORMED)
def test_malformed_jsonl_row_names_file_and_line(tmp_path, tok, bad_row, reason):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "2+2=", "answer": "4"}, "", bad_row])
    with pytest.raises(DataError) as err:
        build_prompt_datasets(cfg_of(train_path=str(path)), tok, 0)
    assert str(err.value).startswith(f"{path}:3: ")
    assert reason in str(err.value) and "data.skip_malformed=true" in str(err.value)


def test_malformed_parquet_row_and_skip_count(tmp_path, tok):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", None, "3+3="], "answer": ["2", "4", "6"]}), path)
    with pytest.raises(DataError, match=rf"^{path} row 1: field 'prompt' is NoneType"):
        build_prompt_datasets(cfg_of(train_path=str(path)), tok, 0)
    ds = load_prompt_datasets(cfg_of(train_path=str(path), skip_malformed=True), tok, 0)
    assert [r.prompt for r in ds.train] == ["1+1=", "3+3="]
    assert ds.train_stats.malformed_skipped == 1 and f"{path} row 1" in ds.train_stats.examples[0]


def test_skip_malformed_counts_every_kind(tmp_path, tok):
    rows = (
        [{"prompt": "0+0=", "answer": "0"}] + [r for r, _ in MALFORMED] + [{"prompt": "9+0=", "answer": "9"}]
    )
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    ds = load_prompt_datasets(cfg_of(train_path=str(path), skip_malformed=True), tok, 0)
    assert [r.prompt for r in ds.train] == ["0+0=", "9+0="]
    assert (ds.train_stats.rows, ds.train_stats.malformed_skipped) == (len(rows), len(MALFORMED))
    assert ds.train_stats.examples[0].startswith(f"{path}:2: bad JSON")
    # nothing usable at all is an error, not an empty run
    only_bad = write_jsonl(tmp_path / "bad.jsonl", ['{"prompt": 1}'])
    with pytest.raises(DataError, match=r"data.train_path: no usable rows .* 1 malformed skipped"):
        build_prompt_datasets(cfg_of(train_path=str(only_bad), skip_malformed=True), tok, 0)


def test_bad_paths_and_sources(tmp_path, tok):
    with pytest.raises(DataError, match=r"data.train_path='.*missing.jsonl' does not exist"):
        build_prompt_datasets(cfg_of(train_path=str(tmp_path / "missing.jsonl")), tok, 0)
    csv = tmp_path / "x.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(DataError, match=r"has suffix '.csv'"):
        build_prompt_datasets(cfg_of(train_path=str(csv)), tok, 0)
    with pytest.raises(DataError, match=r"data.train_path and data.generator are both null"):
        build_prompt_datasets(cfg_of(), tok, 0)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"not a readable Parquet file"):
        build_prompt_datasets(cfg_of(train_path=str(junk)), tok, 0)


def test_no_answer_key(tmp_path, tok):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1="}])
    (rec,), _ = build_prompt_datasets(cfg_of(train_path=str(path), answer_key=None), tok, 0)
    assert rec.answer == "" and rec.metadata == {}


# ---- templates and length -------------------------------------------------------------------


def test_plain_template(tmp_path, tok):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    (rec,), _ = build_prompt_datasets(cfg_of(train_path=str(path), template="Q: {prompt}\nA:"), tok, 0)
    assert rec.prompt == "Q: 1+1=\nA:"
    assert rec.prompt_ids == tuple(tok("Q: 1+1=\nA:").input_ids)
    assert tok.decode(rec.prompt_ids, skip_special_tokens=True) == rec.prompt


def test_chat_template(tmp_path, tok):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    chat_tok = load_tokenizer(Path(tok.name_or_path))
    chat_tok.chat_template = CHAT_TEMPLATE
    cfg = cfg_of(train_path=str(path), template="add {prompt}", chat_template=True, system_prompt="be exact")
    (rec,), _ = build_prompt_datasets(cfg, chat_tok, 0)
    expected = chat_tok.apply_chat_template(
        [{"role": "system", "content": "be exact"}, {"role": "user", "content": "add 1+1="}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rec.prompt == expected == "<s>S:be exact\nU:add 1+1=\nA:"
    # the template wrote bos itself: no second one from the tokenizer
    assert rec.prompt_ids == tuple(chat_tok(expected, add_special_tokens=False).input_ids)
    assert rec.prompt_ids.count(chat_tok.bos_token_id) == 1
    with pytest.raises(DataError, match=r"data.chat_template=true but the tokenizer has no chat template"):
        build_prompt_datasets(cfg_of(train_path=str(path), chat_template=True), tok, 0)


def test_too_long_prompts_dropped_and_counted(tmp_path, tok):
    rows = [{"prompt": "1" * n, "answer": "x"} for n in (3, 9, 4, 10, 5)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    ds = load_prompt_datasets(cfg_of(train_path=str(path), max_prompt_tokens=6), tok, 0)  # bos + 5 chars
    assert [len(r.prompt) for r in ds.train] == [3, 4, 5]
    assert all(len(r.prompt_ids) <= 6 for r in ds.train)
    assert (ds.train_stats.too_long_dropped, ds.train_stats.kept) == (2, 3)
    assert "2 over data.max_prompt_tokens dropped" in ds.train_stats.summary()
    with pytest.raises(DataError, match=r"no usable rows .* 5 over data.max_prompt_tokens=2 dropped"):
        build_prompt_datasets(cfg_of(train_path=str(path), max_prompt_tokens=2), tok, 0)


# ---- SFT ------------------------------------------------------------------------------------


def test_sft_from_file(tmp_path, tok):
    path = write_jsonl(
        tmp_path / "sft.jsonl",
        [
            {"prompt": "1+1=", "response": "2"},
            {"prompt": "2+2=", "response": "4</s>"},  # eos written as text: kept once
            {"prompt": "3+3=", "response": 6, "answer": "6"},
        ],
    )
    dev = write_jsonl(tmp_path / "dev.jsonl", [{"prompt": "5+5=", "answer": "10"}])
    pairs, dev_prompts = build_sft_dataset(cfg_of(train_path=str(path), eval_path=str(dev)), tok, 0)
    eos = tok.eos_token_id
    assert [p.response_ids[-1] for p in pairs] == [eos] * 3
    assert [p.response_ids.count(eos) for p in pairs] == [1, 1, 1]
    assert [tok.decode(p.response_ids, skip_special_tokens=True) for p in pairs] == ["2", "4", "6"]
    assert pairs[0].prompt_ids == tuple(tok("1+1=").input_ids)
    assert [(r.prompt, r.answer) for r in dev_prompts] == [("5+5=", "10")]
    missing = write_jsonl(tmp_path / "noresp.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    with pytest.raises(DataError, match=rf"^{missing}:1: no field 'response'.*data.response_key"):
        build_sft_dataset(cfg_of(train_path=str(missing)), tok, 0)


def test_sft_from_generator_gold_solutions(tok):
    cfg = cfg_of(generator="arithmetic", num_train_prompts=50, num_eval_prompts=10)
    sft = load_sft_datasets(cfg, tok, seed=3)
    prompts, _ = build_prompt_datasets(cfg, tok, seed=3)
    assert len(sft.train) == 50 and len(sft.dev) == 10
    for pair, rec in zip(sft.train, prompts, strict=True):
        assert pair.prompt_ids == rec.prompt_ids
        assert pair.response_ids[-1] == tok.eos_token_id
        assert tok.decode(pair.response_ids, skip_special_tokens=True) == rec.answer
    assert [r.prompt for r in sft.dev] == [r.prompt for r in build_prompt_datasets(cfg, tok, seed=3)[1]]


# ---- sampler --------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_resume_equals_uninterrupted(shuffle):
    sizes = [3, 5, 7, 2, 11, 4, 6]  # batches crossing epoch boundaries of a 10-item dataset
    uninterrupted = PromptSampler(10, seed=7, shuffle=shuffle)
    expected = [uninterrupted.next_indices(n) for n in sizes]
    for k in range(len(sizes) + 1):
        first = PromptSampler(10, seed=7, shuffle=shuffle)
        got = [first.next_indices(n) for n in sizes[:k]]
        state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
        resumed = PromptSampler(10, seed=7, shuffle=shuffle)
        resumed.load_state_dict(state)
        got += [resumed.next_indices(n) for n in sizes[k:]]
        assert got == expected, k
    flat = [i for batch in expected for i in batch]
    for epoch in range(len(flat) // 10):
        assert sorted(flat[10 * epoch : 10 * epoch + 10]) == list(range(10))  # each epoch once
    if not shuffle:
        assert flat[:10] == list(range(10))


def test_sampler_rewind_gives_back_the_last_indices_across_epochs():
    # What an asynchronous checkpoint resumed synchronously does with its submitted batches'
    # prompts (training/groups.py:give_back_submitted).
    from grpo_megatron.training.groups import give_back_submitted

    sampler = PromptSampler(10, seed=3, shuffle=True)
    drawn = [sampler.next_indices(4) for _ in range(4)]  # the last two batches cross an epoch
    saved = {"batches": {"3": {"indices": drawn[2]}, "4": {"indices": drawn[3]}}}  # GroupProducer.state_dict
    assert give_back_submitted(sampler, saved) == 2 and sampler.consumed == 8
    assert [sampler.next_indices(4), sampler.next_indices(4)] == drawn[2:]
    assert give_back_submitted(sampler, {}) == 0 and sampler.consumed == 16
    with pytest.raises(ValueError, match=r"rewind\(17\): 16 indices were drawn"):
        sampler.rewind(17)


def test_sampler_epochs_differ_and_seeds_matter():
    s = PromptSampler(50, seed=1, shuffle=True)
    e0, e1 = s.next_indices(50), s.next_indices(50)
    assert e0 != e1 and sorted(e0) == sorted(e1) == list(range(50))
    assert PromptSampler(50, seed=2, shuffle=True).next_indices(50) != e0
    assert s.consumed == 100 and s.state_dict()["epoch"] == 2
    assert PromptSampler(3, seed=0, shuffle=True).next_indices(7)[6] in range(3)  # wraps over epochs


def test_sampler_refuses_other_settings():
    state = PromptSampler(10, seed=7, shuffle=True).state_dict()
    with pytest.raises(ValueError, match=r"num_items: checkpoint 10 vs now 12"):
        PromptSampler(12, seed=7, shuffle=True).load_state_dict(state)
    with pytest.raises(ValueError, match=r"seed: checkpoint 7 vs now 8 \(set train.seed"):
        PromptSampler(10, seed=8, shuffle=True).load_state_dict(state)
    with pytest.raises(ValueError, match=r"shuffle: checkpoint 1 vs now 0"):
        PromptSampler(10, seed=7, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match=r"lacks \['position'\]"):
        PromptSampler(10, seed=7, shuffle=True).load_state_dict(
            {k: v for k, v in state.items() if k != "position"}
        )


# ---- generators -----------------------------------------------------------------------------


class _Fixed:
    """An rng stand-in returning given operands (to pin the arithmetic format)."""

    def __init__(self, *values):
        self.values = list(values)

    def randrange(self, _n):
        return self.values.pop(0)


def test_arithmetic_format():
    p = arithmetic(_Fixed(42, 317))
    assert (p.prompt, p.answer, p.solution) == ("042+317=", "9530", "9530")
    assert arithmetic(_Fixed(999, 999)).answer == "8991"  # 1998 reversed
    assert arithmetic(_Fixed(5, 7), digits=2, reverse_answer=False).answer == "012"
    p = arithmetic(_Fixed(42, 317), reverse_operands=True)  # every number least-significant digit first
    assert (p.prompt, p.answer, p.metadata) == ("240+713=", "9530", {"a": 42, "b": 317})
    with pytest.raises(ValueError, match="reverse_operands='yes' must be true or false"):
        arithmetic(_Fixed(1, 2), reverse_operands="yes")


@pytest.mark.parametrize(
    "name, kwargs", [("arithmetic", {}), ("arithmetic", {"digits": 1}), ("countdown", {})]
)
def test_generators_deterministic_and_disjoint(name, kwargs):
    train, evals = generate_splits(name, kwargs, seed=11, num_train=2000, num_eval=40)
    again = generate_splits(name, kwargs, seed=11, num_train=2000, num_eval=40)
    assert (train, evals) == again
    other = generate_splits(name, kwargs, seed=12, num_train=2000, num_eval=40)
    assert other[0] != train and other[1] != evals
    eval_prompts = {p.prompt for p in evals}
    assert len(eval_prompts) == 40 and not eval_prompts & {p.prompt for p in train}
    # the held-out set does not move when the training set grows
    assert generate_splits(name, kwargs, seed=11, num_train=10, num_eval=40)[1] == evals


def test_generator_answers_score_full_reward():
    train, evals = generate_splits("countdown", {"num_numbers": 4}, seed=0, num_train=300, num_eval=20)
    for p in train + evals:
        assert len(p.metadata["numbers"]) == 4 and 1 <= p.metadata["target"] <= 100
        sample = RewardSample(prompt=p.prompt, response=p.solution, label=p.answer, metadata=p.metadata)
        assert countdown_reward(sample) == 1.0
    train, _ = generate_splits("arithmetic", {}, seed=0, num_train=100, num_eval=0)
    for p in train:
        a, b = p.metadata["a"], p.metadata["b"]
        assert int(p.answer[::-1]) == a + b
        assert exact_match(RewardSample(prompt=p.prompt, response=p.solution, label=p.answer)) == 1.0


def test_generator_too_small_and_config_errors():
    with pytest.raises(ValueError, match=r"data.num_eval_prompts=150: .* found only 100 distinct"):
        generate_splits("arithmetic", {"digits": 1}, seed=0, num_train=10, num_eval=150)
    bad = [
        (
            dict(generator="sudoku"),
            "data.generator='sudoku' is not a generator: use one of arithmetic, countdown",
        ),
        (
            dict(generator="arithmetic", generator_kwargs={"digit": 3}),
            "['digit'] which generator 'arithmetic'",
        ),
        (
            dict(generator="arithmetic", generator_kwargs={"digits": 0}),
            "digits=0 must be an integer in [1, 18]",
        ),
        (dict(generator="countdown", generator_kwargs={"num_numbers": 9}), "num_numbers=9 must be <= 6"),
        (dict(system_prompt="x"), "data.system_prompt is set but data.chat_template is false"),
        (dict(template="{prompt} {x}"), "data.template='{prompt} {x}' is not a valid format string"),
        (dict(template="no placeholder"), "has no {prompt} placeholder"),
        (dict(answer_key="prompt"), "must name different fields"),
        (dict(num_eval_prompts=-1), "data.num_eval_prompts=-1 must be >= 0"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError) as err:
            DataConfig(**kwargs).validate()
        assert message in str(err.value), (kwargs, str(err.value))


def test_generated_datasets_respect_sizes_and_length(tok):
    cfg = cfg_of(generator="countdown", num_train_prompts=200, num_eval_prompts=0, max_prompt_tokens=11)
    ds = load_prompt_datasets(cfg, tok, seed=5)
    assert ds.eval == [] and ds.eval_stats is None
    assert ds.train_stats.rows == 200 and ds.train_stats.too_long_dropped > 0  # e.g. "17,16,13:100="
    assert len(ds.train) == ds.train_stats.kept and all(len(r.prompt_ids) <= 11 for r in ds.train)
    assert all(
        set(r.metadata) == {"numbers", "target"} and r.answer == str(r.metadata["target"]) for r in ds.train
    )


# ---- tokenizer ------------------------------------------------------------------------------


def test_char_tokenizer_round_trip(tmp_path):
    out = tmp_path / "tok"
    built = build_char_tokenizer("0123456789+= ", out, words=["<answer>"])
    loaded = load_tokenizer(out)
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id, loaded.unk_token_id) == (
        0,
        1,
        2,
        3,
    )
    assert len(loaded) == len(built) == 4 + 13 + 1
    text = "042+317= <answer>9530"
    ids = loaded(text).input_ids
    assert ids == built(text).input_ids
    assert ids[0] == 1 and len(ids) == 1 + len("042+317= ") + 1 + len("9530")  # one token per char, one tag
    assert loaded.decode(ids, skip_special_tokens=True) == text
    assert loaded.decode(ids + [2]) == "<s>" + text + "</s>"
    assert loaded("x").input_ids == [1, 3]  # outside the vocabulary: unk
    assert not list(tmp_path.glob(".tok.tmp-*"))  # the atomic write left no temporary directory


def test_demo_tokenizer_matches_builder(tmp_path):
    demo = load_tokenizer(DEMO_TOKENIZER)
    rebuilt = build_char_tokenizer(DEMO_CHARS, tmp_path / "demo", words=DEMO_WORDS)
    vocab = demo.convert_ids_to_tokens(list(range(len(demo))))
    assert vocab == rebuilt.convert_ids_to_tokens(list(range(len(rebuilt))))
    assert len(demo) < 32 and vocab[:3] == ["<pad>", "<s>", "</s>"]
    hf = (
        json.loads((DEMO_TOKENIZER / "config.json").read_text())
        if (DEMO_TOKENIZER / "config.json").exists()
        else None
    )
    if hf is not None:  # the demo model's config (written beside the tokenizer) must fit it
        assert len(demo) <= hf["vocab_size"]
        assert (hf["pad_token_id"], hf["bos_token_id"], hf["eos_token_id"]) == (0, 1, 2)
    for text in ("042+317=9530", "17,6,13:10=<answer>17-(13-6)</answer>"):
        assert demo.decode(demo(text).input_ids, skip_special_tokens=True) == text
        assert demo.unk_token_id not in demo(text).input_ids


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist: set data.tokenizer_path"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer files.*tools/build_char_tokenizer.py"):
        load_tokenizer(tmp_path)
