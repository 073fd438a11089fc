"""The inference consumer's collaborators, which `stoker.runtime.feeder.Feeder` composes: what it holds (`held`, the
one lock its threads share), the collector, the device, the writer, the errands, the intake and batch-line takers,
the heartbeat, the registry of the jobs it holds, and the cancellations it hears. Each thread's loop is one
collaborator's `step`; each lock has one owner."""
