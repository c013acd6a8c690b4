output "dashboard_url" {
  description = "The monitor's dashboard (also /status and /metrics), reachable from operator_cidr_blocks."
  value       = "http://${aws_instance.monitor.private_ip}:${var.monitor_port}/"
}

output "prometheus_scrape_config" {
  description = "A Prometheus configuration (YAML) scraping the monitor's and every worker's /metrics; Prometheus must run inside operator_cidr_blocks."
  value = templatefile("${path.module}/prometheus.yml.tftpl", {
    name            = var.name
    monitor_targets = ["${aws_instance.monitor.private_ip}:${var.monitor_port}"]
    worker_targets  = [for worker in aws_instance.worker : "${worker.private_ip}:${var.worker_metrics_port}"]
  })
}

output "monitor_private_ip" {
  value = aws_instance.monitor.private_ip
}

output "worker_private_ips" {
  value = aws_instance.worker[*].private_ip
}

output "security_group_ids" {
  description = "The monitor's and the workers' security groups, by role: allow them into the Redis and Kafka groups."
  value       = { monitor = aws_security_group.monitor.id, worker = aws_security_group.worker.id }
}

output "instance_role_name" {
  description = "Attach more policies here (e.g. a KMS key for the SSM parameters)."
  value       = aws_iam_role.crawler.name
}

output "log_group_name" {
  description = "CloudWatch log group of both containers; the monitor's stream holds its JSON events."
  value       = aws_cloudwatch_log_group.crawler.name
}
