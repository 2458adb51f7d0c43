"""Multi-turn and agentic episodes (issue 18): a workflow is `async def episode(ctx, problem) -> reward`.

episode.py  the per-token trace (generated vs environment tokens, versions, loss mask) -> one SeqSample
context.py  `ctx`: generate turns through a backend, append environment text, grade, call the reward service
builtin.py  the built-in workflows (BUILTINS, the registry);  calc.py  the tool's safe arithmetic evaluator
runner.py   load a workflow spec (operator-named code only), run one episode with a timeout
specs.py    resolve a "module:function" the operator named (runner.py and openai_agent.py)
local.py    an in-process engine backend and LocalRewards (evaluations, tests); the agent role is workers/agent.py
openai_agent.py  the `openai_agent` built-in: an agent written with the openai client, through an in-process endpoint
calculator_agent.py  such an agent with a `calculator` function tool (configs/tools-arith.yaml)
docs/workflows.md shows how to write one.
"""
