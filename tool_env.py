"""A multi-turn tool-calling environment in the spirit of report 000 (OS tuning with tools).

The task: which kernel setting does a benchmark depend on, and what value does the
knowledge base recommend? The answer is not in the prompt; only the tools know it. The
setting of each benchmark is fixed, but each episode's knowledge base recommends one of
several values (a different machine, a different tuning guide), so no policy can learn the
answer by heart from the prompt: it has to look the value up and copy it.

    env = ToolEnv()
    prompt = env.reset(seed=0)
    observation, done, info = env.step(policy_text)      # one policy turn

A policy turn is `<think>...</think>` followed by either
    <tool_call>{"name": "query_knowledge_base", "arguments": {"topic": "memory"}}</tool_call>
which the environment answers with `<tool_response>...</tool_response>` (the observation,
appended to the context by the caller), or
    <answer> vm.swappiness = 10 </answer>
which ends the episode (spaces in the answer are ignored). After max_turns turns without an answer the episode ends too.

Difficulty (report 000's "ground truth too long to reach by sampling"): an episode of
difficulty d asks about d different benchmarks, so the answer that earns the reward is d
`setting = value` pairs, each looked up with its own call, in one answer:
    <answer> vm.swappiness = 10 vm.dirty_ratio = 40 </answer>      (d = 2; any order)
The prompt repeats the one-benchmark question for each, in words the tiny model already
has, and the turn limit grows with it: max_turns + d - 1 turns, one more per extra lookup.
Report 000's curriculum ("start from short examples, then add longer, more complex
prompts"), --curriculum with --difficulty D: the run in D equal phases, phase d at difficulty d,

    d(s) = 1 + floor((s - 1) * D / total)          s = 1 .. total        (difficulty_at)

so 100 steps at D = 3 are steps 1-34 at 1, 35-67 at 2, 68-100 at 3. Held-out evaluation
stays at D, the task the run is for.

Every way a turn can fail is a named kind returned in info["failure"], never an exception:
FAILURES below. Model output is parsed with json.loads and matched against plain dicts;
nothing in it is ever evaluated or executed. A generation should stop at STOP_STRINGS, so
the environment can answer before the policy goes on.

info per turn: failure (a kind or None), tool (the tool called, or None), tool_success,
correct_call (the call asked about one of this episode's benchmarks or settings), process_reward
(the tool's own 0.1 for a successful call: report 000 lost it; rewards.py adds it),
answered, correct (the answer, when there is one), turn.
"""
import json
import random
import re
from dataclasses import dataclass, field

# benchmark -> (the setting it depends on, the values a knowledge base may recommend)
KNOWLEDGE_BASE = {
    "cpu": ("kernel.sched_migration_cost_ns", ("500000", "1000000", "5000000")),
    "fileio": ("vm.dirty_ratio", ("20", "40", "60")),
    "memory": ("vm.swappiness", ("1", "10", "30")),
    "network": ("net.core.somaxconn", ("1024", "4096", "8192")),
    "threads": ("kernel.sched_min_granularity_ns", ("3000000", "10000000")),
    "mutex": ("kernel.sched_wakeup_granularity_ns", ("4000000", "15000000")),
}
TOOLS = {   # name -> {argument: type}, the JSON schema of each tool, flattened
    "query_knowledge_base": {"topic": str},
    "analyze_config_impact": {"param": str, "value": str},
}
FAILURES = ("malformed_json", "unknown_tool", "bad_arguments", "empty_result", "no_action",
            "too_long", "degenerate", "turn_limit")
STOP_STRINGS = ("</tool_call>", "</answer>")
MAX_TURN_CHARS = 2000          # a longer turn is "too_long"
MAX_JSON_CHARS = 1000
MAX_DIFFICULTY = 3             # benchmarks per episode at most (tool_task's warm start shows 1 to 3)


@dataclass
class Knobs:
    """Report 000's tool task: its short-to-long curriculum."""
    curriculum: bool = field(default=False, metadata={"help": "tools task: train from difficulty 1 up to "
                             "--difficulty in equal phases (report 000's curriculum: difficulty_at); "
                             "evaluation stays at --difficulty"})


def problems(cfg):
    """(flag, why) for each setting of these knobs train.py refuses (cfg: the whole configuration)."""
    if cfg.curriculum and cfg.difficulty < 2:
        yield "curriculum", (f"moves from difficulty 1 up to --difficulty; give --difficulty 2 or more "
                             f"(it is {cfg.difficulty})")
    if cfg.curriculum and cfg.steps < cfg.difficulty:
        yield "curriculum", f"needs a step per difficulty at least: --steps {cfg.steps} < --difficulty {cfg.difficulty}"


def difficulty_at(step: int, total: int, final: int) -> int:
    """The curriculum's difficulty at step `step` (1-based) of `total`: equal phases from 1 up to `final`."""
    return 1 + (step - 1) * final // total


def tag_body(text: str, name: str) -> str | None:
    """The text between the first <name> and the first </name> after it, or None. Two
    str.find calls: linear in len(text) whatever the text (a regex `<name>(.*?)</name>`
    rescans the rest of the text from every unclosed <name>, which is quadratic)."""
    start = text.find(f"<{name}>")
    if start < 0:
        return None
    start += len(name) + 2
    end = text.find(f"</{name}>", start)
    return None if end < 0 else text[start:end]


# The same character 8+ times ("!!!!!!!!") or the same word 6+ times in a row.
_DEGENERATE = re.compile(r"(\S)\1{7,}|\b(\w+)(?:\s+\2\b){5,}")


def run_tool(name: str, args: dict, kb: dict) -> str:
    """The tools: plain lookups in this episode's knowledge base kb (benchmark -> (setting,
    value)). '' means an empty result. Words are separated by spaces, so a word-level
    tokenizer (the tiny model's) can read every response."""
    if name == "query_knowledge_base":
        topic = args["topic"].strip().lower()
        if topic not in kb:
            return ""
        return f"the {topic} benchmark depends on {kb[topic][0]} , recommended value {kb[topic][1]}"
    settings = dict(kb.values())
    if args["param"] not in settings:
        return ""
    verdict = "recommended" if args["value"].strip() == settings[args["param"]] else "not recommended"
    return f"{args['param']} = {args['value'].strip()} is {verdict} , recommended value {settings[args['param']]}"


def parse_call(text: str) -> tuple[str | None, str | None, dict | None]:
    """(failure, tool name, arguments) of the first <tool_call> in text ("no_action" without one)."""
    body = tag_body(text, "tool_call")
    if body is None:
        return "no_action", None, None
    body = body.strip()
    if len(body) > MAX_JSON_CHARS:
        return "malformed_json", None, None
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return "malformed_json", None, None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return "malformed_json", None, None
    if call["name"] not in TOOLS:
        return "unknown_tool", call["name"], None
    args = call.get("arguments")
    schema = TOOLS[call["name"]]
    if not isinstance(args, dict) or set(args) != set(schema) or \
            not all(isinstance(args[k], t) for k, t in schema.items()):
        return "bad_arguments", call["name"], None
    return None, call["name"], args


def answer_pairs(text: str) -> list[tuple[str, str]] | None:
    """The `setting = value` pairs of an answer's text, spaces ignored, or None when the text
    is anything else: settings are lower-case dotted names, values digits
    ("vm.swappiness=10vm.dirty_ratio=40" reads as two pairs)."""
    flat = text.strip().replace(" ", "")
    if not _PAIRS.fullmatch(flat):
        return None
    return _PAIR.findall(flat)


_PAIR = re.compile(r"([a-z_.]+)=(\d+)")
_PAIRS = re.compile(r"(?:[a-z_.]+=\d+)+")


class ToolEnv:
    stop_strings = STOP_STRINGS      # where a policy turn ends (rollout.sample_episodes stops there)

    def __init__(self, max_turns: int = 3, benchmarks=tuple(KNOWLEDGE_BASE)):
        self.max_turns, self.benchmarks = max_turns, benchmarks
        self.asked, self.kb, self.turn, self.turn_limit, self.done = (), {}, 0, max_turns, True

    def reset(self, seed: int | None = None, difficulty: int = 1) -> str:
        """A new episode about `difficulty` different benchmarks; returns its prompt."""
        if not 1 <= difficulty <= min(MAX_DIFFICULTY, len(self.benchmarks)):
            raise ValueError(f"difficulty must be in [1, {min(MAX_DIFFICULTY, len(self.benchmarks))}], "
                             f"got {difficulty}")
        rng = random.Random(seed)
        # (difficulty 1 draws what rng.choice drew before difficulty existed: the same episodes)
        self.asked = tuple(rng.sample(self.benchmarks, difficulty))
        # This episode's knowledge base: one recommended value per setting.
        self.kb = {b: (param, rng.choice(values)) for b, (param, values) in KNOWLEDGE_BASE.items()}
        self.turn, self.turn_limit, self.done = 0, self.max_turns + difficulty - 1, False
        questions = " ".join(f"Which kernel setting does the {b} benchmark depend on, and what value is "
                             f"recommended ?" for b in self.asked)
        form = " ".join(["setting = value"] * difficulty)
        return f"{questions} Use the tools , then answer as <answer> {form} </answer>"

    @property
    def benchmark(self) -> str | None:
        """The (first) benchmark the episode asks about."""
        return self.asked[0] if self.asked else None

    @property
    def solutions(self) -> list[tuple[str, str]]:
        """[(setting, value)] for each benchmark asked about: the episode's correct answer."""
        return [self.kb[b] for b in self.asked]

    @property
    def solution(self) -> tuple[str, str]:
        """(setting, value) of the first benchmark: the whole answer at difficulty 1."""
        return self.solutions[0]

    def step(self, text: str) -> tuple[str, bool, dict]:
        """One policy turn -> (observation to append, episode done, info)."""
        if self.done:
            raise RuntimeError("step() after the episode ended: call reset() first")
        self.turn += 1
        info = dict(failure=None, tool=None, tool_success=False, correct_call=False,
                    process_reward=0.0, answered=False, correct=None, turn=self.turn)
        observation = ""
        text = text if isinstance(text, str) else ""
        if len(text) > MAX_TURN_CHARS:
            info["failure"] = "too_long"
        elif _DEGENERATE.search(text):
            info["failure"] = "degenerate"
        elif tag_body(text, "answer") is not None:
            given = answer_pairs(tag_body(text, "answer"))
            info.update(answered=True, correct=given is not None and sorted(given) == sorted(self.solutions))
            self.done = True
        elif tag_body(text, "tool_call") is not None:
            failure, name, args = parse_call(text)
            info.update(failure=failure, tool=name)
            if failure is None:
                result = run_tool(name, args, self.kb)
                if result:
                    info.update(tool_success=True, process_reward=0.1,
                                correct_call=self._relevant(name, args))
                    observation = f"<tool_response> {result} </tool_response>"
                else:
                    info["failure"] = "empty_result"
            if info["failure"]:
                # A failed call is answered too: the policy sees what went wrong.
                observation = f"<tool_response> error : {info['failure']} </tool_response>"
        else:
            info["failure"] = "no_action"
        if not self.done and self.turn >= self.turn_limit:
            self.done = True
            if info["failure"] is None:       # the last turn itself went fine: the limit failed
                info["failure"] = "turn_limit"
        return observation, self.done, info

    def _relevant(self, name: str, args: dict) -> bool:
        if name == "query_knowledge_base":
            return args["topic"].strip().lower() in self.asked
        return args["param"] in {param for param, _ in self.solutions}


# ---- where a generated turn ends (rollout.sample_episodes) ----

def stop_ids(tok, stop_strings) -> list | None:
    """The token ids of the stop strings when each is one token (the tiny tokenizer), else None
    (then `generate` matches the strings themselves)."""
    ids = [tok.convert_tokens_to_ids(s) for s in stop_strings]
    return ids if all(i is not None and i != tok.unk_token_id for i in ids) else None


def turn_tokens(generated: list, tok, stops, stop_strings) -> list:
    """The tokens of one turn: up to and including the first stop token, EOS, or the end of
    the first stop string; what `generate` padded after that is dropped."""
    ends = set(stops or []) | {tok.eos_token_id}
    cut = next((t + 1 for t, token in enumerate(generated) if token in ends), len(generated))
    generated = generated[:cut]
    if stops or not any(s in tok.decode(generated) for s in stop_strings):
        return generated
    # A stop string spread over several tokens: the shortest prefix that contains it (one
    # decode of the whole turn above, and this search only when a stop string is there).
    return next(generated[:t + 1] for t in range(len(generated))
                if any(s in tok.decode(generated[:t + 1]) for s in stop_strings))
