output "dashboard_url" {
  value = module.image_crawler.dashboard_url
}

output "worker_private_ips" {
  value = module.image_crawler.worker_private_ips
}

output "log_group_name" {
  value = module.image_crawler.log_group_name
}

output "prometheus_scrape_config" {
  description = "terraform output -raw prometheus_scrape_config > prometheus.yml"
  value       = module.image_crawler.prometheus_scrape_config
}
