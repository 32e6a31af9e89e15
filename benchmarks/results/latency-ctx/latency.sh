# benchmark only: heavy-tailed tool latency, sourced by every `bash -c` (BASH_ENV)
python3 -c "import random,time; time.sleep(min(25.0, random.lognormvariate(-0.6931471805599453, 1.3)))"
