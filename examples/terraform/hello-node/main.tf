# An HTTP function.
resource "sless_function" "hello" {
  name        = "hello-node"
  runtime     = "nodejs20"
  entrypoint  = "handler.main"
  memory_mb   = 128
  timeout_sec = 10
  source_dir  = "${path.module}/code/hello"
  env_vars = {
    GREETING = "${var.greeting}, world"
    RETRIES  = 3
  }
}

resource "sless_trigger" "hello_http" {
  name     = "hello-http"
  type     = "http"
  function = sless_function.hello.name
}

# Two functions share one source_dir: a job's function and an HTTP function.
resource "sless_function" "time_getter" {
  name       = "time-getter"
  runtime    = "nodejs20"
  entrypoint = "getter.main"
  source_dir = "${path.module}/code/time"
}

resource "sless_function" "time_display" {
  name              = "time-display"
  runtime           = "nodejs20"
  entrypoint        = "display.main"
  source_dir        = "${path.module}/code/time"
  build_timeout_sec = 300
  env_vars = {
    JOB_TIME = sless_job.get_time.message
    DB_DSN   = var.db_dsn
  }
  depends_on = [sless_job.get_time]
}

resource "sless_trigger" "time_display_http" {
  name     = "time-display-http"
  type     = "http"
  function = sless_function.time_display.name
}

resource "sless_trigger" "time_display_cron" {
  name     = "time-display-nightly"
  type     = "cron"
  function = sless_function.time_display.name
  schedule = "0 3 * * *"
}

# A one-shot job whose result time-display shows.
resource "sless_job" "get_time" {
  name     = "get-time"
  function = sless_function.time_getter.name
  event_json = jsonencode({
    zone  = "UTC"
    label = "${var.greeting} from terraform"
    tags  = ["import", "fixture"]
  })
  run_id           = 1
  wait_timeout_sec = 120
}

# A Python function on a database: its DSN is a secret, its jobs run in order.
resource "sless_function" "notes" {
  name       = "notes-sql"
  runtime    = "python3.11"
  entrypoint = "sql.run"
  source_dir = "${path.module}/code/notes"
  env_vars = {
    PG_DSN    = var.db_dsn
    API_TOKEN = "tok-fixture-9f3e"
  }
}

resource "sless_job" "create_table" {
  name       = "notes-create-table"
  function   = sless_function.notes.name
  event_json = jsonencode({ statements = ["CREATE TABLE IF NOT EXISTS notes (id serial)"] })
  run_id     = 1
}

resource "sless_job" "seed" {
  name       = "notes-seed"
  function   = sless_function.notes.name
  event_json = jsonencode({ statements = ["INSERT INTO notes DEFAULT VALUES"] })
  run_id     = 2
  depends_on = [sless_job.create_table]
}

output "time_result" {
  value = sless_job.get_time.message
}
