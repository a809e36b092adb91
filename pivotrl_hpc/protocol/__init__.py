"""The vocabulary the controller, the device workers, the engines and the simulator share.

`messages`: the commands the controller sends a worker and the worker's replies.
`engine`: the values an inference engine is given and answers with (options, sampling,
progress, finished and aborted sequences, state).
`context`: the role context kinds that name a shift's phases in a reply (paper §5.2).
`wire`: the typed codec every channel of the job speaks (JSON of these dataclasses, never
pickle); `mpi`: its carriage over MPI as bytes.

Below every layer that speaks it: importing this package imports nothing else of the
project, nor vLLM, torch or MPI (`mpi` loads mpi4py only when a message moves).
"""
