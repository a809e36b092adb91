"""The user's RL task (ARCHITECTURE "The task"): data loading (`data`), prompt rendering with
the models' chat templates (`prompts`), verifiable rewards (`rewards`), the GenRM's judge
prompt and score parsing (`judge`), put together for the controller in `task.RLTask`.
Engines only turn token ids into token ids; everything about text lives here."""
