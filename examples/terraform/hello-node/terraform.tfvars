greeting = "hi"
