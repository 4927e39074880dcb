"""Two agents share a question; the second also reads the first one's answer.

    python examples/two_agents.py http://127.0.0.1:30000
(start the server with: python -m sglang_kvshare.launch_server --model-path ... --kvshare-mode fullshared)
"""
import sys

import sglang as sgl

from sglang_kvshare.frontend import KVShareEndpoint, agent, shared


@sgl.function
def solve_and_check(s, question):
    solver = s.fork(1)[0]
    solver += agent("solver")                                   # who speaks in this fork
    solver += sgl.system("You solve math problems step by step.")
    solver += sgl.user(shared(question, slot="query"))          # same text, same tokens in every agent
    solver += sgl.assistant(sgl.gen("answer", max_tokens=96))
    s += agent("checker")
    s += sgl.system("You check a solution and state the final number.")
    s += sgl.user(shared(question, slot="query") + "\n\nProposed solution:\n"
                  + shared(solver["answer"], slot="out:solver"))
    s += sgl.assistant(sgl.gen("verdict", max_tokens=64))


if __name__ == "__main__":
    backend = KVShareEndpoint(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:30000")
    state = solve_and_check.run(question="Tom has 3 boxes of 12 pens. He gives away 7. How many are left?",
                                backend=backend, temperature=0)
    print(state["verdict"])
    print("server report:", state.get_meta_info("verdict").get("kvshare"))
