"""The tensorboard monitor meets prime's monitor contract; what it records is read back with
TensorBoard's own reader."""

from pathlib import Path

from prime_core.testing.contracts.monitor import MonitorContract


class TestTensorboard(MonitorContract):
    name = "tensorboard"

    def logged(self, output_dir: Path):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(output_dir / "tensorboard" / "trainer"))
        events.Reload()
        records = [(e.step, {tag: e.value}) for tag in events.Tags()["scalars"] for e in events.Scalars(tag)]
        records += [(e.step, {tag: e.tensor_proto.string_val[0].decode()}) for tag in events.Tags()["tensors"]
                    for e in events.Tensors(tag)]
        return records
