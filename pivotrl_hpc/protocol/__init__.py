"""The vocabulary the controller, the device workers, the engines and the simulator share.

`messages`: the commands the controller sends a worker and the worker's replies.
`engine`: the values an inference engine is given and answers with (options, sampling,
progress, finished and aborted sequences, state).

Pure dataclasses below every layer that speaks them: importing this package imports nothing
else of the project, nor vLLM, torch or MPI.
"""
