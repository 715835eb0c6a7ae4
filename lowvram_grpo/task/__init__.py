"""What is learned: where questions enter (data.py), how a stated answer is read (answers.py), how completions are
scored (rewards.py, reward_models.py), the tools the model may call (tools.py) and the user's own files for them
(user_code.py, user_files.py).
"""
