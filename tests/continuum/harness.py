"""A scheduler driven step by step with a fake clock and a fake runner, for policy tests."""

from __future__ import annotations

from engine.kv_cache.pins import Pin
from engine.request import Request
from engine.scheduler.output import SchedulerOutput
from engine.scheduler.policy import PolicyEnvironment, SchedulingPolicy
from engine.scheduler.tracer import SchedulerTracer
from tests.engine.helpers import FakeClock, FakeRunner, make_request, make_scheduler, run_step

# A job's turn calls this tool unless a test says otherwise (turns that call no tool are
# never pinned, and the fake runner's outputs name none).
DEFAULT_TOOL = "bash"


class Harness:
    """Requests never stop early (the runner never samples an EOS), so a request runs for
    exactly its `max_tokens`; every step checks the scheduler's invariants. A turn of a job
    names `DEFAULT_TOOL` unless `tool` is given (None: no tool named). With
    `num_host_kv_blocks`, the scheduler has a host KV tier of that many blocks."""

    def __init__(
        self,
        policy: SchedulingPolicy,
        *,
        num_blocks: int = 32,
        block_size: int = 4,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 64,
        max_model_len: int = 64,
        environment: PolicyEnvironment | None = None,
        tracer: SchedulerTracer | None = None,
        num_host_kv_blocks: int = 0,
        clock: FakeClock | None = None,
    ) -> None:
        self.policy = policy
        self.clock = FakeClock() if clock is None else clock
        self.scheduler = make_scheduler(
            num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            policy=policy, clock=self.clock, environment=environment, tracer=tracer,
            num_host_blocks=num_host_kv_blocks,
        )
        self.runner = FakeRunner(block_size, sample=lambda req_id, position: 1000 + position)
        self.requests: dict[str, Request] = {}
        self.outputs: list[SchedulerOutput] = []

    def add(
        self,
        request_id: str,
        prompt: list[int],
        *,
        job: str | None = None,
        last: bool = False,
        tool: str | None = DEFAULT_TOOL,
        max_tokens: int = 2,
    ) -> Request:
        tool = None if job is None else tool
        request = make_request(
            request_id, prompt, max_tokens=max_tokens, arrival_time_s=self.clock(),
            job_id=job, is_last_step=last, tool_name=tool,
        )
        self.scheduler.add_request(request)
        self.requests[request_id] = request
        return request

    def next_turn(self, request_id: str, previous: str, appended: list[int], **kwargs) -> Request:
        """The job's next turn: the previous turn's prompt and output, then `appended`."""
        before = self.requests[previous]
        assert before.is_finished, f"{previous} has not finished"
        return self.add(request_id, before.all_token_ids + appended, job=before.job_id, **kwargs)

    def step(self, count: int = 1, *, dt_s: float = 0.0) -> SchedulerOutput:
        for _ in range(count):
            output, _ = run_step(self.scheduler, self.runner)
            self.outputs.append(output)
            self.clock.advance(dt_s)
        return output

    def run_until_finished(self, *request_ids: str, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if all(self.requests[r].is_finished for r in request_ids):
                return
            self.step()
        raise AssertionError(f"{request_ids} unfinished after {max_steps} steps")

    def admitted(self, output: SchedulerOutput | None = None) -> list[str]:
        output = self.outputs[-1] if output is None else output
        return [new.req_id for new in output.scheduled_new_reqs]

    def admission_order(self) -> list[str]:
        return [req_id for output in self.outputs for req_id in self.admitted(output)]

    def pin(self, job_id: str) -> Pin | None:
        return self.scheduler.pins.get(job_id)

    @property
    def running_ids(self) -> list[str]:
        return [request.request_id for request in self.scheduler.running]

    @property
    def waiting_ids(self) -> list[str]:
        return [request.request_id for request in self.scheduler.waiting]


def tokens(start: int, count: int) -> list[int]:
    """`count` distinct token ids from `start` (prompts that share nothing unless told)."""
    return list(range(start, start + count))
